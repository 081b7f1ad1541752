"""``onpolicy diagnose`` on the command line: JSON output keys, human report, samples from the real
``generate --json`` and mismatch-store files, exit codes, and one-line usage errors (exit 2)."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
from cli_support import run_in_process
from doctor_support import PROMPT_IDS, TOKEN_IDS, run_cli

REQUIRED = {"divergent", "class", "cause", "layer", "op", "max_abs_logdiff", "module", "position", "phase",
            "first_token_index", "shapes", "backends", "evidence", "facts", "swap", "differing_inputs", "summary"}
IDS = ["--prompt-ids", ",".join(map(str, PROMPT_IDS)), "--token-ids", ",".join(map(str, TOKEN_IDS))]


def assert_usage_error(proc: subprocess.CompletedProcess[str], *fragments: str) -> None:
    assert proc.returncode == 2, (proc.returncode, proc.stdout[-500:], proc.stderr[-2000:])
    lines = proc.stderr.splitlines()
    assert len(lines) == 1, f"expected exactly one stderr line, got:\n{proc.stderr[-2000:]}"
    assert lines[0].startswith("onpolicy") and "Traceback" not in proc.stderr, lines[0]
    assert proc.stdout == ""
    for f in fragments:
        assert f in lines[0], (f, lines[0])


def test_json_output_of_an_operator_fault(tiny_paths: dict[str, Path], capsys: pytest.CaptureFixture[str]) -> None:
    proc = run_in_process(["diagnose", "--model", "tiny-qwen3", *IDS, "--rollout", "kernels=fast,kv_tile=16",
                           "--trainer", "kv_tile=16", "--json"], capsys)
    assert proc.returncode == 1, proc.stderr  # a divergence was diagnosed
    d = json.loads(proc.stdout)
    assert set(d) >= REQUIRED
    assert (d["divergent"], d["class"], d["cause"], d["op"], d["layer"]) == (True, "operator", "kernel", "rmsnorm", 0)
    assert d["max_abs_logdiff"] > 0 and d["backends"]["rollout"].startswith("fast-r8-kv16")
    assert d["facts"]["kernel_config"]["differ"] is True and d["facts"]["weights"]["differ"] is False


def test_consistent_pair_human_report(tiny_paths: dict[str, Path], capsys: pytest.CaptureFixture[str]) -> None:
    proc = run_in_process(["diagnose", "--model", "tiny-llama", "--prompt", "Hello", "--max-new-tokens", "5"], capsys)
    assert proc.returncode == 0, proc.stderr
    assert "verdict: no divergence" in proc.stdout and "max |logdiff| 0" in proc.stdout
    proc = run_in_process(["diagnose", "--model", "tiny-llama", "--prompt", "Hello", "--max-new-tokens", "5", "--json"],
                          capsys)
    d = json.loads(proc.stdout)
    assert (d["divergent"], d["class"], d["cause"], d["max_abs_logdiff"]) == (False, "none", None, 0)


def test_store_samples_and_generate_output(store: Path, generated: dict[str, dict],
                                          capsys: pytest.CaptureFixture[str]) -> None:
    """Real files: a mismatch-store sample (subprocess, as the skill runs it) and generate's output."""
    fast = sorted((store / "job-fast").glob("*.json"))[0]
    proc = run_cli(["diagnose", str(fast), "--json"])
    assert proc.returncode == 1, proc.stderr[-2000:]
    d = json.loads(proc.stdout)
    assert (d["class"], d["op"], d["layer"]) == ("operator", "rmsnorm", 0)
    assert d["backends"]["rollout"] == generated["fast"]["kernel_fingerprint"]
    assert "rollout_matches_sample" in d["replay"] and "trainer_matches_sample" in d["replay"]
    assert d["replay"]["trainer_matches_sample"] is True  # the store's trainer logprobs are reproduced
    gen = store.parent / "generate-consistent.json"
    gen.write_text(json.dumps(generated["consistent"]))
    proc = run_in_process(["diagnose", str(gen), "--json"], capsys)
    assert proc.returncode == 0, proc.stderr[-2000:]
    d = json.loads(proc.stdout)
    assert (d["class"], d["max_abs_logdiff"]) == ("none", 0) and d["replay"]["rollout_matches_sample"] is True


@pytest.mark.parametrize(("args", "fragment"), [
    (["/no/such/sample.json"], "no such file"),
    (["--model", "tiny-qwen3"], "--prompt"),
    ([], "SAMPLE"),
    (["--model", "tiny-qwen3", "--prompt-ids", "1,x"], "--prompt-ids"),
    (["--model", "tiny-qwen3", "--prompt-ids", "[]"], "--prompt-ids"),
    (["--model", "tiny-qwen3", "--prompt-ids", "1,2", "--rollout", "bogus=1"], "unknown key 'bogus'"),
    (["--model", "tiny-qwen3", "--prompt-ids", "1,2", "--rollout", "kernels=nope"], "nope"),
    (["--model", "tiny-qwen3", "--prompt-ids", "1,2", "--rollout", "dtype=fp64"], "dtype"),
    (["--model", "tiny-qwen3", "--prompt-ids", "1,2", "--trainer", "kv_tile=abc"], "kv_tile"),
    (["--model", "tiny-qwen3", "--prompt-ids", "1,2", "--trainer", "temperature=0"], "temperature"),
    (["--model", "tiny-qwen3", "--prompt-ids", "1,2", "--rollout", "weights=/no/such.safetensors"], "does not exist"),
    (["--model", "tiny-qwen3", "--prompt-ids", "1,99999"], "outside the vocabulary"),
    (["--model", "no-such-model", "--prompt-ids", "1,2"], "unknown model"),
    (["--model", "tiny-qwen3", "--prompt-ids", "1,2", "--max-new-tokens", "0"], "--max-new-tokens"),
    (["--model", "tiny-qwen3", "--prompt", "a", "--prompt-ids", "1"], "not allowed with"),
])
def test_bad_input_is_one_line_exit_2(args: list[str], fragment: str, tiny_paths: dict[str, Path],
                                      capsys: pytest.CaptureFixture[str]) -> None:
    assert_usage_error(run_in_process(["diagnose", *args], capsys), fragment)


def test_bad_files_are_one_line_exit_2(tmp_path: Path, tiny_paths: dict[str, Path],
                                       capsys: pytest.CaptureFixture[str]) -> None:
    bad_json = tmp_path / "bad.json"
    bad_json.write_text("{not json")
    assert_usage_error(run_in_process(["diagnose", str(bad_json)], capsys), "not valid JSON")
    no_tokens = tmp_path / "no-tokens.json"
    no_tokens.write_text(json.dumps({"model": "tiny-qwen3", "prompt_ids": [1, 2]}))
    assert_usage_error(run_in_process(["diagnose", str(no_tokens)], capsys), "token_ids")
    no_model = tmp_path / "no-model.json"
    no_model.write_text(json.dumps({"prompt_ids": [1, 2], "token_ids": [3]}))
    assert_usage_error(run_in_process(["diagnose", str(no_model)], capsys), "--model")
    short = tmp_path / "short-logprobs.json"
    short.write_text(json.dumps({"model": "tiny-qwen3", "prompt_ids": [1, 2], "token_ids": [3, 4], "logprobs": [0.0]}))
    assert_usage_error(run_in_process(["diagnose", str(short)], capsys), "logprobs")
    both = tmp_path / "ok.json"
    both.write_text(json.dumps({"model": "tiny-qwen3", "prompt_ids": [1, 2], "token_ids": [3]}))
    assert_usage_error(run_in_process(["diagnose", str(both), "--prompt", "x"], capsys), "not both")
    garbage = tmp_path / "garbage.safetensors"
    garbage.write_bytes(b"\x00" * 64)
    assert_usage_error(run_in_process(["diagnose", "--model", "tiny-qwen3", "--prompt-ids", "1,2", "--rollout",
                                       f"weights={garbage}"], capsys), "unreadable weights file")
    # and as a real subprocess: no traceback, one line
    assert_usage_error(run_cli(["diagnose", str(bad_json)]), "not valid JSON")
