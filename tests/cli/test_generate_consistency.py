"""The generate and consistency commands, run as a user would (subprocess, real engine)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

CLI = [sys.executable, "-m", "onpolicy.cli.main"]


def onpolicy(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run([*CLI, *args], capture_output=True, text=True, timeout=600)
    if check and proc.returncode != 0:
        raise AssertionError(f"exit {proc.returncode}: {proc.stderr}")
    return proc


def test_generate_json_feeds_logprobs_bitwise(tmp_path: Path) -> None:
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "2+2="}\n{"prompt_ids": [5, 6, 7, 8]}\n\n{"prompt": "hello there"}\n')
    out = onpolicy("generate", "--model", "tiny-qwen3", "--prompts", str(prompts), "--n", "2", "--max-new-tokens", "20",
                   "--temperature", "0.7", "--seed", "3", "--max-num-seqs", "3", "--max-batched-tokens", "9", "--json")
    gen = json.loads(out.stdout)
    assert gen["model"] == "tiny-qwen3" and gen["kernel_fingerprint"].startswith("reference-")
    comps = gen["completions"]
    assert [(c["prompt_index"], c["sample_index"]) for c in comps] == [(i, s) for i in range(3) for s in range(2)]
    for c in comps:
        assert len(c["token_ids"]) == len(c["logprobs"]) >= 1 and c["finish_reason"] in ("stop", "length")
        assert isinstance(c["text"], str)
    inp = tmp_path / "completions.json"
    inp.write_text(json.dumps(comps))
    scored = json.loads(onpolicy("logprobs", "--model", "tiny-qwen3", "--input", str(inp), "--json").stdout)
    assert scored["weight_sha256"] == gen["weight_sha256"]
    assert [r["logprobs"] for r in scored["results"]] == [c["logprobs"] for c in comps]  # exact floats


def test_generate_human_output_has_progress() -> None:
    out = onpolicy("generate", "--model", "tiny-llama", "--prompt", "hi", "--max-new-tokens", "5")
    assert "--- prompt 0 sample 0" in out.stdout
    assert "tokens/s" in out.stderr


@pytest.mark.parametrize("args, needle", [
    (["--prompt", "x", "--temperature", "-1"], "temperature"),
    (["--prompt", "x", "--n", "0"], "n must be"),
    (["--prompts", "/nonexistent.jsonl"], "no such file"),
    (["--prompt", "x", "--max-num-seqs", "0"], "max_num_seqs"),
])
def test_generate_bad_input_is_one_line_exit_2(args: list[str], needle: str) -> None:
    proc = onpolicy("generate", "--model", "tiny-llama", *args, check=False)
    assert proc.returncode == 2
    assert len(proc.stderr.strip().splitlines()) == 1 and needle in proc.stderr
    assert "Traceback" not in proc.stderr


def test_generate_prompt_ids_out_of_vocab(tmp_path: Path) -> None:
    f = tmp_path / "p.jsonl"
    f.write_text('{"prompt_ids": [1, 99999]}\n')
    proc = onpolicy("generate", "--model", "tiny-llama", "--prompts", str(f), check=False)
    assert proc.returncode == 2 and "vocabulary" in proc.stderr and "Traceback" not in proc.stderr


def test_consistency_passes_on_tiny_moe_and_fails_with_fast_kernels() -> None:
    ok = onpolicy("consistency", "--model", "tiny-qwen3-moe", "--requests", "6", "--max-new-tokens", "24",
                  "--kv-tile", "16", "--json")
    rep = json.loads(ok.stdout)
    assert rep["passed"] and rep["mismatched_tokens"] == 0 and rep["max_abs_logdiff"] == 0.0
    assert rep["tokens_checked"] == 5 * 6 * 24 and len(rep["schedules"]) == 5
    bad = onpolicy("consistency", "--model", "tiny-qwen3-moe", "--requests", "6", "--max-new-tokens", "24",
                   "--kv-tile", "16", "--kernels", "fast", "--json", check=False)
    assert bad.returncode == 1
    rep = json.loads(bad.stdout)
    assert not rep["passed"] and rep["mismatched_tokens"] > 0 and rep["max_abs_logdiff"] > 0
