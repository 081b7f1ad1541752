"""``--top-p`` / ``--top-k`` / ``--min-p`` on ``onpolicy generate`` and ``onpolicy logprobs``, run
as a user would: generate's JSON carries each completion's truncation, ``logprobs`` on that JSON
gives back the exact floats, the flags are the default of items without their own, and bad values
are one-line usage errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from test_generate_consistency import onpolicy


def test_generate_truncated_json_feeds_logprobs_bitwise(tmp_path: Path) -> None:
    out = onpolicy("generate", "--model", "tiny-qwen3", "--prompt", "2+2=", "--n", "3", "--max-new-tokens", "16",
                   "--temperature", "0.7", "--top-p", "0.8", "--top-k", "40", "--min-p", "0.05", "--seed", "2",
                   "--json")
    comps = json.loads(out.stdout)["completions"]
    for c in comps:
        assert c["top_k"] == 40 and abs(c["top_p"] - 0.8) < 1e-7 and abs(c["min_p"] - 0.05) < 1e-8
    inp = tmp_path / "gen.json"
    inp.write_text(out.stdout)
    scored = json.loads(onpolicy("logprobs", "--model", "tiny-qwen3", "--input", str(inp), "--json").stdout)
    assert [r["logprobs"] for r in scored["results"]] == [c["logprobs"] for c in comps]  # exact floats
    # the same tokens scored without truncation differ (off-policy by construction)
    plain = [{k: c[k] for k in ("prompt_ids", "token_ids", "temperature")} for c in comps]
    (tmp_path / "plain.json").write_text(json.dumps(plain))
    base = ["logprobs", "--model", "tiny-qwen3", "--input", str(tmp_path / "plain.json"), "--json"]
    untruncated = json.loads(onpolicy(*base).stdout)["results"]
    assert [r["logprobs"] for r in untruncated] != [c["logprobs"] for c in comps]
    # ... and the flags restore it for items without their own truncation
    flagged = json.loads(onpolicy(*base, "--top-p", "0.8", "--top-k", "40", "--min-p", "0.05").stdout)["results"]
    assert [r["logprobs"] for r in flagged] == [c["logprobs"] for c in comps]


@pytest.mark.parametrize("cmd, args, needle", [
    ("generate", ["--prompt", "x", "--top-p", "0"], "--top-p"),
    ("generate", ["--prompt", "x", "--top-k", "-2"], "--top-k"),
    ("generate", ["--prompt", "x", "--min-p", "1.5"], "--min-p"),
    ("logprobs", ["--input", "/dev/null", "--top-p", "2"], "--top-p"),
])
def test_bad_truncation_flags_are_one_line_exit_2(cmd: str, args: list[str], needle: str) -> None:
    proc = onpolicy(cmd, "--model", "tiny-llama", *args, check=False)
    assert proc.returncode == 2
    assert len(proc.stderr.strip().splitlines()) == 1 and needle in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr
