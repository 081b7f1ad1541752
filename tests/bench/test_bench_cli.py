"""``onpolicy bench``: every suite runs end to end through the real CLI on a tiny model (``--quick``)
and its JSON has the documented schema. Timings are never asserted (benchmarks, not timed tests)."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

SUITE_NAMES = {"vs-hf/rollout/bs1/fp32", "vs-hf/rollout/bs32/fp32", "vs-hf/trainer/fp32",
               "roofline/decode/bs1/fp32", "roofline/decode/bs32/fp32", "rl-step/no-recompute/fp32"}


def bench(*args: str) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, RAY_USAGE_STATS_ENABLED="0")
    env.pop("PYTHONWARNINGS", None)
    return subprocess.run([sys.executable, "-m", "onpolicy.cli.main", "bench", *args], capture_output=True,
                          text=True, env=env, timeout=300, check=False)


def test_bench_all_quick_json_schema(tiny_paths: dict[str, Path]) -> None:
    proc = bench("all", "--model", "tiny-llama", "--quick", "--json")
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout)
    assert report["command"].startswith("onpolicy bench all") and report["commands"]
    assert {"cpu", "cores", "memory_gib", "cpu_capability", "torch_threads"} <= set(report["machine"])
    assert {"python", "torch", "transformers", "onpolicy"} <= set(report["versions"])
    names = [r["name"] for r in report["results"]]
    assert set(names) == SUITE_NAMES and len(names) == len(set(names))
    for r in report["results"]:
        assert set(r) == {"name", "ours", "baseline", "ratio", "unit", "note"}
        assert r["ours"] > 0 and r["baseline"] > 0 and math.isfinite(r["ours"]) and math.isfinite(r["baseline"])
        assert r["ratio"] == pytest.approx(r["ours"] / r["baseline"], rel=1e-3)
        assert r["unit"] in {"tokens/s", "steps/s"}
    details = report["details"]
    assert details["max_abs_logdiff"]["fp32"]["ours_consistent"] == 0.0  # the contract, on the bench's own run
    assert details["roofline"]["read_bandwidth_gb_s"] > 0
    rounds = details["roofline"]["fp32"]["bs1_rounds"]  # bandwidth and decode measured back to back
    assert len(rounds) == details["setup"]["rounds"] and all(r["read_bandwidth_gb_s"] > 0 for r in rounds)
    steps = details["roofline"]["fp32"]["decode_step_ms"]  # where a decode step's time went, per phase
    assert set(steps) == {"bs1", "bs32"}
    for phases in steps.values():
        assert set(phases) == {"schedule", "inputs", "layers", "head", "sample", "update"}
        assert all(ms > 0 for ms in phases.values())
    times = details["rl_step_seconds"]["fp32"]
    assert times["no_recompute"]["recompute_s"] == 0.0 and times["recompute"]["recompute_s"] > 0
    assert details["setup"]["model"] == "tiny-llama"
    # vLLM's CPU attention has no head_dim 16: vs-vllm is reported as skipped, with the reason, not a crash
    assert "head_dim 16" in details["skipped"]["vs-vllm"] or "vllm" in details["skipped"]["vs-vllm"]


def test_bench_suite_table_and_usage_errors(tiny_paths: dict[str, Path]) -> None:
    proc = bench("vs-hf", "--model", "tiny-llama", "--quick", "--batches", "2", "--rounds", "2", "--json")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads(proc.stdout)["details"]["setup"]["rounds"] == 2  # engines alternated twice
    proc = bench("vs-hf", "--model", "tiny-llama", "--quick", "--batches", "2")
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    assert lines[0].split()[:4] == ["benchmark", "ours", "baseline", "ratio"]
    assert any(line.startswith("vs-hf/rollout/bs2/fp32 ") for line in lines)
    for args, fragment in ((["--batches", "1,x"], "--batches"), (["--new-tokens", "0"], "--new-tokens"),
                           (["--rounds", "0"], "--rounds"),
                           (["--model", "no-such-model"], "no-such-model")):
        bad = bench("roofline", "--quick", *args)
        assert bad.returncode == 2, bad.stderr[-2000:]
        assert len(bad.stderr.splitlines()) == 1 and fragment in bad.stderr
    bad = bench("overhead", "--quick")  # retired: vs-vllm measures against the fastest non-invariant engine
    assert bad.returncode == 2 and "overhead" in bad.stderr


def test_bench_gemm_is_a_subcommand() -> None:
    proc = bench("gemm", "--help")
    assert proc.returncode == 0 and "--threads" in proc.stdout and "--rows" in proc.stdout
    bad = bench("gemm", "--rows", "0")
    assert bad.returncode == 2 and "--rows" in bad.stderr
