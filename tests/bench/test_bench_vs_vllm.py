"""``onpolicy bench vs-vllm``: through the real CLI on a tiny head_dim-32 model at tiny sizes, with a
real vLLM (marked ``vllm``): the result names, positive finite ratios, both engines' logdiff against
our trainer (ours exactly 0); and, with vLLM hidden, the suite reports itself skipped with the reason
instead of failing. Timings are never asserted (benchmarks, not timed tests)."""

from __future__ import annotations

import importlib.util
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest


def bench(*args: str) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, RAY_USAGE_STATS_ENABLED="0")
    env.pop("PYTHONWARNINGS", None)
    return subprocess.run([sys.executable, "-m", "onpolicy.cli.main", "bench", *args], capture_output=True,
                          text=True, env=env, timeout=600, check=False)


SIZES = ("--quick", "--vllm-eager", "--batches", "1,2", "--prompt-len", "8", "--new-tokens", "4", "--rounds", "2")


@pytest.mark.vllm
@pytest.mark.skipif(importlib.util.find_spec("vllm") is None,
                    reason="vllm is not installed (bash scripts/setup.sh --vllm)")
def test_vs_vllm_results_and_logdiffs(tiny_paths: dict[str, Path]) -> None:
    proc = bench("vs-vllm", "--model", "tiny-llama-hd32", *SIZES, "--json")
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout)
    names = [r["name"] for r in report["results"]]
    assert names == [f"vs-vllm/rollout/bs{b}/{d}" for d in ("fp32", "bf16") for b in (1, 2)]
    for r in report["results"]:
        assert r["unit"] == "tokens/s" and r["ratio"] > 0 and math.isfinite(r["ratio"])
        assert r["ratio"] == pytest.approx(r["ours"] / r["baseline"], rel=1e-3)
    details = report["details"]["vs_vllm"]
    for dtype in ("fp32", "bf16"):
        assert details["max_abs_logdiff"][dtype]["ours"] == 0.0  # the contract, on the bench's own run
        assert math.isfinite(details["max_abs_logdiff"][dtype]["vllm"])
        for b in (1, 2):
            runs = details["rounds_tokens_s"][f"bs{b}/{dtype}"]
            assert len(runs["ours"]) == len(runs["vllm"]) == 2  # alternating rounds, medians reported
    assert details["vllm"]["enforce_eager"] is True and "skipped" not in report["details"]


def test_vs_vllm_without_vllm_is_skipped_with_reason(tiny_paths: dict[str, Path], monkeypatch: pytest.MonkeyPatch,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    from onpolicy.cli.main import main

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name.split(".")[0] == "vllm" else real(name, *a))
    assert main(["bench", "vs-vllm", "--model", "tiny-llama-hd32", *SIZES, "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["results"] == []
    assert "vllm" in report["details"]["skipped"]["vs-vllm"] and "setup.sh --vllm" in report["details"]["skipped"][
        "vs-vllm"]
