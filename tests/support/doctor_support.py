"""Shared by the doctor tests: the kernel config a sample would carry, a fixed sequence (22-token
prompt + 16-token continuation) that crosses several 16-position KV tiles, and CLI helpers."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from onpolicy.kernels import KernelConfig

FINGERPRINT = KernelConfig(kv_tile=16).fingerprint
PROMPT_IDS = [1, 72, 101, 108, 108, 111, 44, 32, 119, 111, 114, 108, 100, 33, 32, 84, 101, 108, 108, 32, 109, 101]
TOKEN_IDS = [32, 97, 32, 115, 116, 111, 114, 121, 32, 97, 98, 111, 117, 116, 32, 99]

ROOT = Path(__file__).resolve().parents[2]
SKILL = ROOT / "skills" / "consistency-doctor"


def cli_env() -> dict[str, str]:
    env = dict(os.environ, RAY_USAGE_STATS_ENABLED="0")
    env.pop("PYTHONWARNINGS", None)
    return env


def run_cli(args: list[str], timeout: float = 240) -> subprocess.CompletedProcess[str]:
    """The real ``onpolicy`` command line, as a subprocess."""
    return subprocess.run([sys.executable, "-m", "onpolicy.cli.main", *args], capture_output=True, text=True,
                          env=cli_env(), timeout=timeout, check=False)


def store_sample(gen: dict, index: int, job: str, step: int, trainer_logprobs: list[float]) -> dict:
    """A mismatch-store sample (the verifier's schema) from one completion of ``generate --json``."""
    c = gen["completions"][index]
    diffs = [abs(a - b) for a, b in zip(c["logprobs"], trainer_logprobs, strict=True)]
    first = next((i for i, (a, b) in enumerate(zip(c["logprobs"], trainer_logprobs, strict=True)) if a != b), -1)
    return {"kind": "onpolicy.mismatch", "schema_version": 1, "model": gen["model"],
            "kernel_fingerprint": gen["kernel_fingerprint"], "weight_version": 0, "weights_path": "",
            "prompt_ids": c["prompt_ids"], "token_ids": c["token_ids"], "logprobs": c["logprobs"],
            "trainer_logprobs": trainer_logprobs, "temperature": c["temperature"], "source": "onpolicy",
            "job_id": job, "step": step, "max_abs_logdiff": max(diffs), "first_mismatch_index": first,
            "mismatched_tokens": sum(d > 0 for d in diffs)}
