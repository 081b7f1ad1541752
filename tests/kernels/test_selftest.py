"""The self-test certifies the reference backend on this machine and refuses the fast one; the
certificate round-trips through ``$ONPOLICY_HOME``."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from onpolicy.kernels import KernelConfig
from onpolicy.kernels.selftest import (
    ProbeShapes,
    SelftestReport,
    certificate_path,
    is_certified,
    run_selftest,
    save_certificate,
)

TINY = ProbeShapes()  # hidden 64, 4 heads / 2 KV heads of 16, intermediate 128, vocab 320: the tiny models
TINY_MOE = ProbeShapes(intermediate=32, num_experts=8, top_k=2)
EXPECTED_PROBES = {
    "elementwise/exp-log-paths", "rmsnorm", "rmsnorm/head", "rope", "swiglu", "logprobs/lm-head-log-softmax",
    "moe/route", "moe/route-ids", "attention/prefill-vs-training", "attention/paged-decode-vs-training",
    "attention/chunked-prefill-paged-vs-training", "attention/threads", "sampling/alone-vs-batch",
    "linear/rowdot-paths",
}


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("kv_tile", [16, 32, 64])
def test_reference_backend_certified(dtype: str, kv_tile: int) -> None:
    """Also the precondition of the attention-path tests, which use kv_tile 16 and 32."""
    cfg = KernelConfig(compute_dtype=dtype, kv_tile=kv_tile)
    report = run_selftest(cfg, TINY)
    failed = [(p.name, p.detail) for p in report.probes if not p.passed]
    assert report.certified, failed
    names = {p.name for p in report.probes}
    assert names >= EXPECTED_PROBES
    assert sum(n.startswith("linear/") for n in names) == 5  # four model linears + rowdot's paths
    assert all(p.checked > 0 for p in report.probes)
    assert report.fingerprint == cfg.fingerprint and report.backend == "reference"


@pytest.mark.parametrize("shapes", [TINY_MOE, ProbeShapes(num_kv_heads=4), ProbeShapes(num_kv_heads=1)],
                         ids=["moe", "gqa1", "gqa4"])
def test_reference_backend_certified_other_shapes(shapes: ProbeShapes) -> None:
    report = run_selftest(KernelConfig(kv_tile=16), shapes)
    assert report.certified, [(p.name, p.detail) for p in report.probes if not p.passed]


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_fast_backend_not_certified(dtype: str) -> None:
    report = run_selftest(KernelConfig(backend="fast", compute_dtype=dtype, kv_tile=16), TINY)
    failed = [p for p in report.probes if not p.passed]
    assert not report.certified
    assert failed, "the fast backend passed every invariance probe"
    assert all(p.detail for p in failed), "a failed probe must say what differed"
    # the non-invariant fused attention (SDPA) is caught on the decode path
    assert any(p.name.startswith("attention/") for p in failed)


def test_uncertified_report_needs_probes() -> None:
    cfg = KernelConfig()
    empty = SelftestReport("reference", cfg.fingerprint, TINY, {})
    assert not empty.certified


def test_progress_reports_every_probe() -> None:
    lines: list[str] = []
    report = run_selftest(KernelConfig(kv_tile=16), TINY, lines.append)
    assert len(lines) == len(report.probes)
    assert all(line.startswith("ok") for line in lines)


def test_report_to_dict_is_json() -> None:
    report = run_selftest(KernelConfig(kv_tile=16), TINY)
    d = json.loads(json.dumps(report.to_dict()))
    assert d["certified"] is True
    assert d["fingerprint"] == KernelConfig(kv_tile=16).fingerprint
    assert d["shapes"]["hidden"] == 64
    assert {"torch", "threads", "cpu_capability"} <= set(d["machine"])
    assert d["machine"]["torch"] == torch.__version__
    assert len(d["probes"]) == len(report.probes) and {"name", "passed", "checked", "detail"} <= set(d["probes"][0])


def test_selftest_leaves_thread_count_alone() -> None:
    before = torch.get_num_threads()
    run_selftest(KernelConfig(kv_tile=16), TINY)
    assert torch.get_num_threads() == before


# ---------------------------------------------------------------------------------------- certificates


def test_certificate_round_trip(tmp_home: Path) -> None:
    cfg = KernelConfig(kv_tile=16)
    path = certificate_path(cfg)
    assert path.parent == tmp_home / "certificates"
    assert cfg.fingerprint in path.name
    assert not is_certified(cfg)

    report = run_selftest(cfg, TINY)
    saved = save_certificate(report, cfg)
    assert saved == path and saved.is_file()
    assert json.loads(saved.read_text())["certified"] is True
    assert is_certified(cfg)
    assert not list(saved.parent.glob("*.tmp*")), "atomic write left a temporary file"

    # a certificate is for one fingerprint only
    assert not is_certified(cfg.with_(kv_tile=32))
    assert not is_certified(cfg.with_(compute_dtype="bf16"))


def test_uncertified_report_does_not_certify(tmp_home: Path) -> None:
    cfg = KernelConfig(backend="fast", kv_tile=16)
    report = run_selftest(cfg, TINY)
    save_certificate(report, cfg)
    assert certificate_path(cfg).is_file()
    assert not is_certified(cfg)


def test_failed_rerun_revokes_certificate(tmp_home: Path) -> None:
    cfg = KernelConfig(kv_tile=16)
    save_certificate(run_selftest(cfg, TINY), cfg)
    assert is_certified(cfg)
    bad = run_selftest(cfg, TINY)
    bad.probes[0].passed = False
    save_certificate(bad, cfg)
    assert not is_certified(cfg)


@pytest.mark.parametrize("content", [
    "", "{not json", '{"certified": false}', '{"backend": "reference"}', b"\xff\xfe not utf-8",
    "[]", "null",
])
def test_corrupt_or_negative_certificate_is_not_certified(tmp_home: Path, content: str | bytes) -> None:
    cfg = KernelConfig(kv_tile=16)
    path = certificate_path(cfg)
    path.parent.mkdir(parents=True)
    path.write_bytes(content if isinstance(content, bytes) else content.encode())
    assert not is_certified(cfg)


def test_certificates_follow_onpolicy_home(tmp_home: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = KernelConfig(kv_tile=16)
    save_certificate(run_selftest(cfg, TINY), cfg)
    assert is_certified(cfg)
    other = tmp_path / "elsewhere"
    monkeypatch.setenv("ONPOLICY_HOME", str(other))
    assert certificate_path(cfg).is_relative_to(other)
    assert not is_certified(cfg)


@pytest.mark.parametrize("kv_tile", [
    1, 2, 8,
])
def test_selftest_runs_for_every_valid_kv_tile(kv_tile: int) -> None:
    """Whether small KV tiles are invariant is a machine fact; the self-test must answer, not crash."""
    report = run_selftest(KernelConfig(kv_tile=kv_tile), TINY)
    assert report.probes and all(p.checked > 0 for p in report.probes)
    assert report.certified in (True, False)
