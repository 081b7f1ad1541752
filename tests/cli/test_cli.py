"""The real ``onpolicy`` command line, run as a subprocess: selftest JSON, logprobs that are
byte-identical for any packing and whose floats round-trip exactly, and one-line usage errors
(exit code 2, no traceback)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from cli_support import run_in_process

from onpolicy.kernels import KernelConfig
from onpolicy.trainer.forward import ScoredSequence, sequence_logprobs

SEQS = [
    {"prompt_ids": [1, 2, 3], "token_ids": [4, 5, 6]},
    {"prompt_ids": [7], "token_ids": [8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19]},
    {"prompt_ids": list(range(30, 100)), "token_ids": [256, 258, 0, 319], "temperature": 0.6},
    {"prompt_ids": [100, 101], "token_ids": [102]},
]


def run_cli(args: list[str], home: Path, timeout: float = 240) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, ONPOLICY_HOME=str(home), RAY_USAGE_STATS_ENABLED="0")
    env.pop("PYTHONWARNINGS", None)
    return subprocess.run([sys.executable, "-m", "onpolicy.cli.main", *args], capture_output=True, text=True,
                          env=env, timeout=timeout, check=False)


def write_json(path: Path, obj: object) -> Path:
    path.write_text(json.dumps(obj))
    return path


@pytest.fixture
def seqs_file(tmp_path: Path) -> Path:
    return write_json(tmp_path / "seqs.json", SEQS)


def assert_usage_error(proc: subprocess.CompletedProcess[str], *fragments: str) -> None:
    assert proc.returncode == 2, (proc.returncode, proc.stderr[-2000:])
    lines = proc.stderr.splitlines()
    assert len(lines) == 1, f"expected exactly one stderr line, got:\n{proc.stderr[-2000:]}"
    assert "Traceback" not in proc.stderr
    assert lines[0].startswith("onpolicy"), lines[0]
    assert proc.stdout == ""
    for f in fragments:
        assert f in lines[0], (f, lines[0])


# --------------------------------------------------------------------------------------------- selftest


def test_selftest_json_certifies_reference(tmp_home: Path) -> None:
    proc = run_cli(["selftest", "--model", "tiny-qwen3", "--json"], tmp_home)
    assert proc.returncode == 0, proc.stderr[-2000:]
    report = json.loads(proc.stdout)
    assert report["certified"] is True
    assert report["backend"] == "reference"
    assert report["fingerprint"] == KernelConfig().fingerprint
    assert isinstance(report["probes"], list) and len(report["probes"]) >= 10
    assert all(p["passed"] is True and p["checked"] > 0 for p in report["probes"])
    assert report["shapes"]["hidden"] == 64 and report["shapes"]["vocab"] == 320
    # the certificate was saved under the (private) home, and nowhere else
    certs = list((tmp_home / "certificates").glob("*.json"))
    assert len(certs) == 1 and json.loads(certs[0].read_text())["certified"] is True


# -------------------------------------------------------------------------------------------- logprobs


def test_logprobs_byte_identical_across_packings_and_exact(tmp_home: Path, seqs_file: Path,
                                                           load_tiny: Callable[..., object]) -> None:
    outs = {}
    for pack_tokens in ("1", "7", "4096"):
        proc = run_cli(["logprobs", "--model", "tiny-qwen3", "--input", str(seqs_file), "--json",
                        "--pack-tokens", pack_tokens], tmp_home)
        assert proc.returncode == 0, proc.stderr[-2000:]
        outs[pack_tokens] = proc.stdout
    assert outs["1"] == outs["7"] == outs["4096"]
    doc = json.loads(outs["4096"])
    assert doc["model"] == "tiny-qwen3"
    assert doc["kernel_fingerprint"] == KernelConfig().fingerprint
    assert len(doc["results"]) == len(SEQS)

    # the floats round-trip: they are exactly the fp32 values of the same computation in-process
    lm = load_tiny("tiny-qwen3", "fp32", kv_tile=64)
    assert doc["weight_sha256"] == lm.weights_sha256  # type: ignore[attr-defined]
    seqs = [ScoredSequence(tuple(s["prompt_ids"]), tuple(s["token_ids"]), s.get("temperature", 1.0)) for s in SEQS]
    with torch.no_grad():
        want = sequence_logprobs(lm.model, seqs)  # type: ignore[attr-defined]
    for r, s, w in zip(doc["results"], SEQS, want, strict=True):
        assert len(r["logprobs"]) == len(s["token_ids"])
        got = torch.tensor(r["logprobs"], dtype=torch.float32)
        assert torch.equal(got, w)
        assert [float(x) for x in got.tolist()] == r["logprobs"]  # fp32 -> JSON -> fp32 is lossless


def test_logprobs_per_item_temperature_and_flag(tmp_home: Path, tmp_path: Path,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    """--temperature is the default for items without their own."""
    item = {"prompt_ids": [1, 2, 3], "token_ids": [4, 5]}
    f1 = write_json(tmp_path / "a.json", [item])
    f2 = write_json(tmp_path / "b.json", [{**item, "temperature": 0.5}])
    base = ["logprobs", "--model", "tiny-llama", "--json", "--input"]
    a = run_in_process([*base, str(f1), "--temperature", "0.5"], capsys)
    b = run_in_process([*base, str(f2)], capsys)
    c = run_in_process([*base, str(f1)], capsys)
    assert a.returncode == b.returncode == c.returncode == 0, (a.stderr, b.stderr, c.stderr)
    assert json.loads(a.stdout)["results"] == json.loads(b.stdout)["results"]
    assert json.loads(a.stdout)["results"] != json.loads(c.stdout)["results"]


def test_logprobs_from_checkpoint_dir_without_tokenizer(tmp_home: Path, tmp_path: Path, seqs_file: Path,
                                                        tiny_paths: dict[str, Path],
                                                        capsys: pytest.CaptureFixture[str]) -> None:
    ckpt = tmp_path / "bare-ckpt"
    ckpt.mkdir()
    for f in ("config.json", "model.safetensors"):
        shutil.copy(tiny_paths["tiny-qwen3"] / f, ckpt / f)
    assert not (ckpt / "tokenizer.json").exists()
    bare = run_cli(["logprobs", "--model", str(ckpt), "--input", str(seqs_file), "--json"], tmp_home)
    assert bare.returncode == 0, bare.stderr[-2000:]
    named = run_in_process(["logprobs", "--model", "tiny-qwen3", "--input", str(seqs_file), "--json"], capsys)
    assert named.returncode == 0, named.stderr
    a, b = json.loads(bare.stdout), json.loads(named.stdout)
    assert a["results"] == b["results"]
    assert a["weight_sha256"] == b["weight_sha256"]
    assert a["model"] == str(ckpt)


def test_logprobs_text_output(tmp_home: Path, seqs_file: Path, capsys: pytest.CaptureFixture[str]) -> None:
    proc = run_in_process(["logprobs", "--model", "tiny-qwen3-moe", "--input", str(seqs_file)], capsys)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.strip().splitlines()
    assert len(lines) == len(SEQS)
    assert lines[0].startswith("[0] 3 tokens")


# ----------------------------------------------------------------------------------------- usage errors
# The six cases of the brief run the real subprocess; the long tail of other bad inputs runs the same
# entry point in-process (``main(argv)``), which is what the subprocess executes, at a fraction of the cost.


def _malformed(d: Path) -> Path:
    p = d / "malformed.json"
    p.write_text('[{"prompt_ids": [1, 2], "token_ids": [3]')
    return p


def _binary(d: Path) -> Path:
    p = d / "binary.json"
    p.write_bytes(b"\xff\xfe\x00[")
    return p


@pytest.mark.parametrize(("case", "make_args", "fragment"), [
    ("missing file", lambda d, f: ["--model", "tiny-qwen3", "--input", str(d / "nope.json")], "no such file"),
    ("unknown model", lambda d, f: ["--model", "no-such-model", "--input", str(f)], "no-such-model"),
    ("ids out of vocab", lambda d, f: ["--model", "tiny-qwen3", "--input",
                                       str(write_json(d / "oov.json", [{"prompt_ids": [1], "token_ids": [320]}]))],
     "outside the vocabulary"),
    ("empty list", lambda d, f: ["--model", "tiny-qwen3", "--input", str(write_json(d / "empty.json", []))],
     "non-empty JSON list"),
    ("malformed JSON", lambda d, f: ["--model", "tiny-qwen3", "--input", str(_malformed(d))], "not valid JSON"),
    ("temperature 0", lambda d, f: ["--model", "tiny-qwen3", "--input", str(f), "--temperature", "0"], "temperature"),
])
def test_bad_input_subprocess(tmp_home: Path, seqs_file: Path, case: str,
                              make_args: Callable[[Path, Path], list[str]], fragment: str) -> None:
    proc = run_cli(["logprobs", "--json", *make_args(seqs_file.parent, seqs_file)], tmp_home)
    assert_usage_error(proc, fragment)


BAD_INPUTS: dict[str, tuple[object, str]] = {
    "not a list": ({"prompt_ids": [1]}, "non-empty JSON list"),
    "item not an object": ([[1, 2]], "item 0 is not an object"),
    "empty prompt": ([{"prompt_ids": [], "token_ids": [1]}], "prompt_ids"),
    "empty tokens": ([{"prompt_ids": [1], "token_ids": []}], "token_ids"),
    "missing tokens": ([{"prompt_ids": [1]}], "token_ids"),
    "float id": ([{"prompt_ids": [1.5], "token_ids": [1]}], "prompt_ids"),
    "bool id": ([{"prompt_ids": [True], "token_ids": [1]}], "prompt_ids"),
    "string id": ([{"prompt_ids": ["a"], "token_ids": [1]}], "prompt_ids"),
    "bad item temperature": ([{"prompt_ids": [1], "token_ids": [2], "temperature": 0}], "temperature"),
    "negative id": ([{"prompt_ids": [-1], "token_ids": [2]}], "outside the vocabulary"),
    "second item bad": ([SEQS[0], {"prompt_ids": [1], "token_ids": [99999]}], "sequence 1"),
}


@pytest.mark.parametrize("case", list(BAD_INPUTS))
def test_bad_input_file_is_one_line_usage_error(tmp_home: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                case: str) -> None:
    content, fragment = BAD_INPUTS[case]
    f = write_json(tmp_path / "bad.json", content)
    assert_usage_error(run_in_process(["logprobs", "--model", "tiny-qwen3", "--input", str(f), "--json"], capsys),
                       fragment)


@pytest.mark.parametrize(("case", "make_args", "fragment"), [
    ("not utf-8", lambda d, f: ["--model", "tiny-qwen3", "--input", str(_binary(d))], "not valid JSON"),
    ("input is a directory", lambda d, f: ["--model", "tiny-qwen3", "--input", str(d)], "not a regular file"),
    ("model file not gguf", lambda d, f: ["--model", str(f), "--input", str(f)], ".gguf"),
    ("dir without config", lambda d, f: ["--model", str(d), "--input", str(f)], "config.json"),
    ("temperature nan", lambda d, f: ["--model", "tiny-qwen3", "--input", str(f), "--temperature", "nan"],
     "temperature"),
    ("negative temperature", lambda d, f: ["--model", "tiny-qwen3", "--input", str(f), "--temperature=-1"],
     "temperature"),
    ("pack tokens 0", lambda d, f: ["--model", "tiny-qwen3", "--input", str(f), "--pack-tokens", "0"], "pack-tokens"),
    ("kv tile not power of two", lambda d, f: ["--model", "tiny-qwen3", "--input", str(f), "--kv-tile", "48"],
     "kv_tile"),
    ("unknown kernels", lambda d, f: ["--model", "tiny-qwen3", "--input", str(f), "--kernels", "turbo"], "turbo"),
    ("bad dtype", lambda d, f: ["--model", "tiny-qwen3", "--input", str(f), "--dtype", "fp64"], "dtype"),
    ("missing --input", lambda d, f: ["--model", "tiny-qwen3"], "--input"),
    ("non-integer pack tokens", lambda d, f: ["--model", "tiny-qwen3", "--input", str(f), "--pack-tokens", "x"],
     "pack-tokens"),
])
def test_bad_arguments_are_one_line_usage_errors(tmp_home: Path, seqs_file: Path, capsys: pytest.CaptureFixture[str],
                                                 case: str, make_args: Callable[[Path, Path], list[str]],
                                                 fragment: str) -> None:
    proc = run_in_process(["logprobs", *make_args(seqs_file.parent, seqs_file)], capsys)
    assert_usage_error(proc, fragment)


def test_selftest_unknown_model_is_usage_error(tmp_home: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert_usage_error(run_in_process(["selftest", "--model", "no-such-model", "--json"], capsys), "no-such-model")


def test_unknown_subcommand_is_usage_error(tmp_home: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert_usage_error(run_in_process(["frobnicate"], capsys))
