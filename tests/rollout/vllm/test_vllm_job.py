"""A GRPO job whose rollout runs on vLLM with our operators, end to end as a user runs it:
``onpolicy demo --engine vllm`` (embedded Ray on loopback, gRPC rollout / trainer / verifier
services, a weight push per step). Every step's completions are recomputed by the verifier on the
training path: logdiff 0, nothing mismatched."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import pytest

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None,
                       reason="vllm is not installed (bash scripts/setup.sh --vllm)"),
]


def test_grpo_job_on_vllm_has_logdiff_zero_every_step(tmp_path) -> None:
    env = dict(os.environ, RAY_USAGE_STATS_ENABLED="0", RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0")
    proc = subprocess.run([sys.executable, "-m", "onpolicy.cli.main", "demo", "--engine", "vllm", "--model",
                           "tiny-llama-hd32", "--steps", "2", "--json", "--state-dir", str(tmp_path)],
                          capture_output=True, text=True, env=env, timeout=600, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    events = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    steps = [e for e in events if int(e.get("step", 0)) > 0 and e.get("state") == "JOB_STATE_RUNNING"]
    assert len({e["step"] for e in steps}) == 2, events
    for e in steps:
        assert int(e["tokens_checked"]) > 0 and int(e.get("tokens_mismatched", 0)) == 0, e
        assert float(e.get("logdiff_max", 0.0)) == 0.0, e
    assert any("SUCCEEDED" in str(e.get("state")) for e in events), events
