#!/usr/bin/env python3
"""Scrape the verifier's Prometheus endpoint(s) and print a consistency verdict.

usage: check_metrics.py URL [URL ...] [--json] [--max-lag SECONDS] [--timeout SECONDS]

URL is a /metrics endpoint (``http://host:port`` gets ``/metrics`` appended); give the rollout and
trainer endpoints too to compare weight versions and kernel fingerprints across roles.

Exit codes: 0 OK (logdiff bitwise 0; warnings may be printed), 1 MISMATCH (some token's logprobs
differ), 2 the endpoint could not be scraped or is not Prometheus text, 3 NO-DATA (nothing verified
yet). Needs only the standard library (uses prometheus_client's parser when it is installed).
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
import urllib.request
from collections import defaultdict

Sample = tuple[str, dict[str, str], float]
_LINE = re.compile(r'^([A-Za-z_:][A-Za-z0-9_:]*)(\{(.*)\})?\s+(\S+)(\s+\S+)?$')
_LABEL = re.compile(r'([A-Za-z_][A-Za-z0-9_]*)="((?:[^"\\]|\\.)*)"')


def parse(text: str) -> list[Sample]:
    """Samples of a Prometheus text exposition."""
    try:
        from prometheus_client.parser import text_string_to_metric_families
    except ImportError:  # pragma: no cover - the fallback parser below
        text_string_to_metric_families = None
    if text_string_to_metric_families is not None:
        return [(s.name, dict(s.labels), float(s.value)) for fam in text_string_to_metric_families(text)
                for s in fam.samples]
    out: list[Sample] = []
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        m = _LINE.match(line)
        if not m:
            raise ValueError(f"not Prometheus text: {line[:80]!r}")
        labels = {k: bytes(v, "utf-8").decode("unicode_escape") for k, v in _LABEL.findall(m.group(3) or "")}
        out.append((m.group(1), labels, float(m.group(4))))
    return out


def scrape(url: str, timeout: float) -> list[Sample]:
    if not re.match(r"^https?://[^/]+/.+", url):
        url = url.rstrip("/") + "/metrics"
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return parse(r.read().decode("utf-8"))


def summarise(samples: list[Sample], max_lag: float) -> dict[str, object]:
    """Aggregate over label sets and derive the verdict, warnings and next steps."""
    total: dict[str, float] = defaultdict(float)
    maxima: dict[str, float] = {}
    dropped: dict[str, float] = defaultdict(float)
    versions: dict[str, float] = {}
    fingerprints: dict[str, str] = {}
    zero_bucket = count = 0.0
    for name, labels, value in samples:
        if name in ("onpolicy_tokens_checked_total", "onpolicy_tokens_mismatched_total",
                    "onpolicy_sequences_checked_total"):
            total[name] += value
        elif name in ("onpolicy_logdiff_max", "onpolicy_kl_k3", "onpolicy_verification_lag_seconds"):
            maxima[name] = max(maxima.get(name, -math.inf), value)
        elif name == "onpolicy_samples_dropped_total":
            dropped[labels.get("reason", "")] += value
        elif name == "onpolicy_weight_version":
            versions[labels.get("role", "") or "?"] = value
        elif name == "onpolicy_kernel_config_info" and value:
            fingerprints[labels.get("role", "") or "?"] = labels.get("fingerprint", "")
        elif name == "onpolicy_logdiff_bucket" and labels.get("le") in ("0", "0.0"):
            zero_bucket += value
        elif name == "onpolicy_logdiff_count":
            count += value
    checked, mismatched = total["onpolicy_tokens_checked_total"], total["onpolicy_tokens_mismatched_total"]
    logdiff_max = maxima.get("onpolicy_logdiff_max", 0.0)
    warnings, hints = [], []
    if len(set(fingerprints.values())) > 1:
        warnings.append(f"kernel fingerprints differ across roles: {fingerprints}")
        hints.append("kernel_config (or operator, if only kernels=fast vs consistent differ)")
    if len(set(versions.values())) > 1:
        warnings.append(f"weight versions differ across roles: {versions}")
        hints.append("weights (stale rollout weights)")
    if dropped.get("stale_weights", 0) > 0:
        warnings.append(f"{dropped['stale_weights']:.0f} samples dropped as stale_weights: rollout lags the trainer")
    lag = maxima.get("onpolicy_verification_lag_seconds")
    if lag is not None and lag > max_lag:
        warnings.append(f"verification lag {lag:.0f} s > {max_lag:.0f} s: the verifier is behind")
    if not samples or not any(n.startswith("onpolicy_") for n, _, _ in samples):
        verdict = "NO-DATA"
        warnings.append("no onpolicy_* metrics at this endpoint (is it the verifier?)")
    elif checked == 0:
        verdict = "NO-DATA"
    elif mismatched > 0 or logdiff_max > 0:
        verdict = "MISMATCH"
        if logdiff_max >= 1e-2:
            hints.append("large logdiff: likely framework (temperature, tokenization, weights, positions)")
        elif logdiff_max > 0:
            hints.append("tiny logdiff: likely operator or kernel_config/dtype (summation order)")
    else:
        verdict = "OK"
    return {
        "verdict": verdict, "tokens_checked": checked, "tokens_mismatched": mismatched,
        "mismatch_fraction": mismatched / checked if checked else 0.0,
        "sequences_checked": total["onpolicy_sequences_checked_total"], "logdiff_max": logdiff_max,
        "kl_k3": maxima.get("onpolicy_kl_k3", 0.0), "exact_zero_fraction": zero_bucket / count if count else None,
        "verification_lag_seconds": lag, "samples_dropped": dict(dropped), "weight_versions": versions,
        "kernel_fingerprints": fingerprints, "warnings": warnings, "hints": hints,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="Verdict on the verifier's logdiff metrics")
    p.add_argument("urls", nargs="+", metavar="URL")
    p.add_argument("--json", action="store_true")
    p.add_argument("--max-lag", type=float, default=300.0, help="warn above this verification lag (s)")
    p.add_argument("--timeout", type=float, default=5.0)
    args = p.parse_args(argv)
    samples: list[Sample] = []
    for url in args.urls:
        try:
            samples.extend(scrape(url, args.timeout))
        except Exception as e:  # unreachable, HTTP error, not Prometheus text: one line, exit 2
            print(f"check_metrics: cannot scrape {url}: {e}", file=sys.stderr)
            return 2
    s = summarise(samples, args.max_lag)
    if args.json:
        print(json.dumps(s))
    else:
        print(f"verdict: {s['verdict']}: {s['tokens_mismatched']:.0f} of {s['tokens_checked']:.0f} tokens differ, "
              f"max |logdiff| {s['logdiff_max']:.3g}, k3 KL {s['kl_k3']:.3g}, "
              f"{s['sequences_checked']:.0f} sequences checked")
        if s["weight_versions"] or s["kernel_fingerprints"]:
            print(f"  weight versions: {s['weight_versions']}  kernel fingerprints: {s['kernel_fingerprints']}")
        if s["samples_dropped"]:
            print(f"  samples dropped: {s['samples_dropped']}")
        for w in s["warnings"]:  # type: ignore[attr-defined]
            print(f"  warning: {w}")
        for h in s["hints"]:  # type: ignore[attr-defined]
            print(f"  hint: {h}")
        if s["verdict"] == "MISMATCH":
            print("  next: scripts/triage.sh MISMATCH_DIR (the mismatch store) to diagnose the worst samples")
    return {"OK": 0, "MISMATCH": 1, "NO-DATA": 3}[str(s["verdict"])]


if __name__ == "__main__":
    sys.exit(main())
