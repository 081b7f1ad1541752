"""The consistency-doctor agent skill: SKILL.md frontmatter and content, and its scripts run for
real — check_metrics.py against a local HTTP server serving prometheus_client metrics, triage.sh
over a mismatch store of samples produced by ``onpolicy generate``."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import yaml
from doctor_support import SKILL, cli_env
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

METRICS = ["onpolicy_logdiff", "onpolicy_logdiff_max", "onpolicy_tokens_checked_total",
           "onpolicy_tokens_mismatched_total", "onpolicy_sequences_checked_total", "onpolicy_kl_k3",
           "onpolicy_weight_version", "onpolicy_verification_lag_seconds", "onpolicy_samples_dropped_total",
           "onpolicy_kernel_config_info"]
CAUSES = ["weights", "dtype", "positions", "attention_mask", "temperature", "tokenization", "kernel_config",
          "parallel_layout", "rng"]


def test_skill_md_frontmatter_and_content() -> None:
    text = (SKILL / "SKILL.md").read_text()
    m = re.match(r"^---\n(.*?)\n---\n", text, re.S)
    assert m, "SKILL.md must start with YAML frontmatter"
    front = yaml.safe_load(m.group(1))
    assert front["name"] == "consistency-doctor"
    assert isinstance(front["description"], str) and 50 < len(front["description"]) <= 1024
    for name in [*METRICS, *CAUSES, "operator", "framework", "onpolicy diagnose", "scripts/check_metrics.py",
                 "scripts/triage.sh", "max_abs_logdiff", "first_mismatch_index"]:
        assert name in text, name


# --------------------------------------------------------------------------------------- check_metrics


def verifier_registry(*, checked: float, mismatched: float, logdiff_max: float, fingerprints: dict[str, str],
                      versions: dict[str, int]) -> CollectorRegistry:
    """Metrics shaped like the verifier's (names, labels, the ``le="0"`` bucket)."""
    reg = CollectorRegistry()
    base = ["job", "model", "role"]
    lab = {"job": "j1", "model": "tiny-qwen3", "role": "verifier"}
    Counter("onpolicy_tokens_checked", "", base, registry=reg).labels(**lab).inc(checked)
    Counter("onpolicy_tokens_mismatched", "", base, registry=reg).labels(**lab).inc(mismatched)
    Counter("onpolicy_sequences_checked", "", base, registry=reg).labels(**lab).inc(checked // 8)
    Gauge("onpolicy_logdiff_max", "", base, registry=reg).labels(**lab).set(logdiff_max)
    Gauge("onpolicy_kl_k3", "", base, registry=reg).labels(**lab).set(logdiff_max ** 2 / 2)
    Gauge("onpolicy_verification_lag_seconds", "", base, registry=reg).labels(**lab).set(1.5)
    dropped = Counter("onpolicy_samples_dropped", "", [*base, "reason"], registry=reg)
    dropped.labels(**lab, reason="stale_weights").inc(0)
    hist = Histogram("onpolicy_logdiff", "", base, buckets=(0.0, 1e-7, 1e-6, 1e-3), registry=reg)
    for i in range(int(checked)):
        hist.labels(**lab).observe(logdiff_max if i < mismatched else 0.0)
    info = Gauge("onpolicy_kernel_config_info", "", [*base, "fingerprint", "backend", "kv_tile", "dtype"],
                 registry=reg)
    version = Gauge("onpolicy_weight_version", "", base, registry=reg)
    for role, fp in fingerprints.items():
        info.labels(job="j1", model="tiny-qwen3", role=role, fingerprint=fp, backend=fp.split("-")[0],
                    kv_tile="16", dtype="fp32").set(1)
    for role, v in versions.items():
        version.labels(job="j1", model="tiny-qwen3", role=role).set(v)
    return reg


@pytest.fixture
def metrics_server() -> Iterator[tuple[str, dict[str, bytes]]]:
    """A local HTTP server: ``/metrics`` serves ``state["body"]``; anything else is a 404."""
    state: dict[str, bytes] = {"body": b""}

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            if self.path != "/metrics":
                self.send_error(404)
                return
            self.send_response(200)
            self.send_header("Content-Type", "text/plain; version=0.0.4")
            self.end_headers()
            self.wfile.write(state["body"])

        def log_message(self, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", state
    finally:
        server.shutdown()
        server.server_close()


def check_metrics(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(SKILL / "scripts" / "check_metrics.py"), *args], capture_output=True,
                          text=True, timeout=60, check=False)


def test_check_metrics_verdicts(metrics_server: tuple[str, dict[str, bytes]]) -> None:
    url, state = metrics_server
    fp = "reference-r8-kv16-fp32-v1-7b5feec8"
    state["body"] = generate_latest(verifier_registry(checked=64, mismatched=0, logdiff_max=0.0,
                                                      fingerprints={"verifier": fp}, versions={"verifier": 3}))
    ok = check_metrics(url)  # the base URL gets /metrics appended
    assert ok.returncode == 0, ok.stderr
    assert ok.stdout.startswith("verdict: OK: 0 of 64 tokens differ") and "warning" not in ok.stdout

    state["body"] = generate_latest(verifier_registry(
        checked=64, mismatched=5, logdiff_max=4.7e-7, fingerprints={"verifier": fp, "rollout": "fast-r8-kv16-x"},
        versions={"verifier": 3, "rollout": 2}))
    bad = check_metrics(f"{url}/metrics")
    assert bad.returncode == 1, bad.stderr
    assert bad.stdout.startswith("verdict: MISMATCH: 5 of 64 tokens differ, max |logdiff| 4.7e-07")
    assert "kernel fingerprints differ" in bad.stdout and "weight versions differ" in bad.stdout
    assert "triage.sh" in bad.stdout
    js = check_metrics(url, "--json")
    s = json.loads(js.stdout)
    assert s["verdict"] == "MISMATCH" and s["tokens_mismatched"] == 5 and s["exact_zero_fraction"] == 59 / 64
    assert s["kernel_fingerprints"] == {"verifier": fp, "rollout": "fast-r8-kv16-x"}

    state["body"] = generate_latest(verifier_registry(checked=0, mismatched=0, logdiff_max=0.0,
                                                      fingerprints={"verifier": fp}, versions={"verifier": 0}))
    assert check_metrics(url).returncode == 3  # nothing verified yet


def test_check_metrics_unreachable_is_exit_2(metrics_server: tuple[str, dict[str, bytes]]) -> None:
    url, _ = metrics_server
    missing = check_metrics(f"{url}/nope")
    assert missing.returncode == 2 and "cannot scrape" in missing.stderr
    closed = check_metrics("http://127.0.0.1:9/metrics", "--timeout", "2")
    assert closed.returncode == 2 and len(closed.stderr.splitlines()) == 1


# ---------------------------------------------------------------------------------------------- triage


def triage(*args: str) -> subprocess.CompletedProcess[str]:
    env = dict(cli_env(), ONPOLICY=f"{sys.executable} -m onpolicy.cli.main", PYTHON=sys.executable)
    return subprocess.run(["bash", str(SKILL / "scripts" / "triage.sh"), *args], capture_output=True, text=True,
                          env=env, timeout=600, check=False)


@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
def test_triage_diagnoses_the_worst_samples(store: Path) -> None:
    proc = triage(str(store), "3")
    assert proc.returncode == 1, proc.stdout + proc.stderr  # some sample diverges
    lines = proc.stdout.splitlines()
    per_sample = [ln for ln in lines if ln.startswith(str(store))]
    assert len(per_sample) == 3
    fast = [ln for ln in per_sample if "/job-fast/" in ln]
    assert len(fast) == 2 and all("operator/kernel at rmsnorm (layer 0)" in ln for ln in fast)
    consistent = [ln for ln in per_sample if "/job-consistent/" in ln]
    assert consistent and consistent[0].endswith("none (no divergence on replay)")
    summary = next(ln for ln in lines if ln.startswith("summary: "))
    assert "operator/kernel 2" in summary and "none 1" in summary
    assert any(ln.strip().startswith("operator/kernel: ") for ln in lines)  # what to do


@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
def test_triage_usage(tmp_path: Path) -> None:
    empty = triage(str(tmp_path))
    assert empty.returncode == 0 and "no samples" in empty.stdout
    assert triage(str(tmp_path / "missing")).returncode == 2
    assert triage(str(tmp_path), "zero").returncode == 2
    assert os.access(SKILL / "scripts" / "triage.sh", os.X_OK)
