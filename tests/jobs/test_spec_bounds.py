"""Red-team findings 7, 11 and 12: bounded reads of job specs, datasets and model configs; NUL
characters, duplicate keys and deep nesting refused with one line naming the field or the place.

The CLI runs as a real subprocess (exit code and stderr as a user sees them); SubmitJob runs over
real gRPC on 127.0.0.1 against a controller whose launcher would start real Ray actors."""

from __future__ import annotations

import json
import os
import secrets
import subprocess
import sys
from pathlib import Path

import grpc
import pytest

from onpolicy.cli.main import main
from onpolicy.jobs.dataset import MAX_JSONL_LINE_BYTES, DatasetError, load_dataset
from onpolicy.jobs.spec import DatasetSpec, SpecError, load_spec_file, parse_spec
from onpolicy.jobs.spec_file import MAX_SPEC_BYTES
from onpolicy.models.config import MAX_CONFIG_BYTES, read_config_json
from onpolicy.services import api
from onpolicy.services.common.client import connect, field_violations
from onpolicy.services.common.server import ServerConfig

TOKEN = secrets.token_urlsafe(16)
ONPOLICY = Path(sys.executable).with_name("onpolicy")


def one_line_error(argv: list[str], capsys) -> str:
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    return err[0]


def test_a_spec_nested_100000_deep_is_one_line_exit_2(tmp_path: Path) -> None:
    deep = tmp_path / "deep.yaml"
    deep.write_text("[" * 100_000)
    out = subprocess.run([str(ONPOLICY), "submit", str(deep), "--address", "127.0.0.1:1"], capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 2, out.stderr[-2000:]
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in out.stderr, lines[:5]
    assert str(deep) in lines[0] and "nested deeper than 64 levels" in lines[0] and "line 1, column 65" in lines[0]


def test_duplicate_keys_are_refused_with_line_and_column(tmp_path: Path, capsys) -> None:
    spec = tmp_path / "dup.yaml"
    spec.write_text("model: tiny-qwen3\nsteps: 2\ngrpo:\n  lr: 0.1\n  lr: 0.2\n")
    line = one_line_error(["submit", str(spec), "--address", "127.0.0.1:1"], capsys)
    assert "duplicate key 'lr'" in line and "line 5, column 3" in line, line
    spec.write_text("model: tiny-qwen3\nsteps: 2\nmodel: tiny-llama\n")
    with pytest.raises(SpecError) as e:
        load_spec_file(spec)
    assert str(e.value).endswith("at line 3, column 1: duplicate key 'model'")


def test_yaml_aliases_are_refused_before_they_expand(tmp_path: Path, capsys) -> None:
    """Nine lines of nested aliases would expand to 10^9 nodes (the billion laughs)."""
    laughs = tmp_path / "laughs.yaml"
    lines = ["model: tiny-qwen3", 'a0: &a0 ["lol"]']
    lines += [f"a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * 10)}]" for i in range(1, 10)]
    laughs.write_text("\n".join(lines) + "\n")
    line = one_line_error(["submit", str(laughs), "--address", "127.0.0.1:1"], capsys)
    assert "aliases (*name) are not accepted" in line and "line 3, column 10" in line, line


def test_an_oversized_spec_file_is_refused_unread(tmp_path: Path, capsys) -> None:
    big = tmp_path / "big.yaml"
    with open(big, "wb") as f:  # sparse: 100 MB that costs no disk
        f.write(b"name: x\n")
        f.truncate(100_000_000)
    line = one_line_error(["submit", str(big), "--address", "127.0.0.1:1"], capsys)
    assert str(big) in line and f"larger than {MAX_SPEC_BYTES >> 20} MiB" in line


def test_nul_characters_are_refused_naming_the_field(tmp_path: Path, capsys) -> None:
    spec = tmp_path / "nul.yaml"
    spec.write_text('model: tiny-qwen3\nname: "a\\0b"\n')
    line = one_line_error(["submit", str(spec), "--address", "127.0.0.1:1"], capsys)
    assert "name: must not contain NUL characters" in line, line
    with pytest.raises(SpecError) as e:
        parse_spec({"model": "tiny-qwen3", "rewards": [{"name": "exact\x00match"}],
                    "dataset": {"kind": "jsonl", "path": "/x\x00y"}})
    assert [f for f, _ in e.value.violations] == ["dataset.path", "rewards[0].name"]


@pytest.fixture
def jobs_stub(tmp_path: Path):
    from onpolicy.services.cluster.actors import RayLauncher
    from onpolicy.services.controller.controller import JobController
    from onpolicy.services.controller.servicer import jobs_server

    controller = JobController(tmp_path / "state", RayLauncher())
    server = jobs_server(controller, ServerConfig(port=0, token=TOKEN))
    channel = connect(server.address, token=TOKEN)
    yield api.jobs_pb2_grpc.JobServiceStub(channel), controller
    channel.close()
    controller.shutdown()
    server.stop()


def test_submitjob_refuses_nul_and_oversized_specs(jobs_stub) -> None:
    stub, controller = jobs_stub
    for spec, field in ((api.jobs_pb2.JobSpec(model="tiny-qwen3", name="a\x00b"), "spec.name"),
                        (api.jobs_pb2.JobSpec(model="tiny-qwen3", name="x" * (MAX_SPEC_BYTES + 1)), "spec")):
        with pytest.raises(grpc.RpcError) as e:
            stub.SubmitJob(api.jobs_pb2.SubmitJobRequest(spec=spec), timeout=60)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert [f for f, _ in field_violations(e.value)] == [field], e.value.details()[:200]
    assert controller.list() == []  # nothing stored


def test_a_jsonl_dataset_is_streamed_with_a_line_bound(tmp_path: Path) -> None:
    sparse = tmp_path / "sparse.jsonl"
    with open(sparse, "wb") as f:  # 512 MiB of NULs on no disk: one endless line
        f.truncate(512 << 20)
    import resource

    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    with pytest.raises(DatasetError) as e:
        load_dataset(DatasetSpec(kind="jsonl", path=str(sparse)))
    grew_mib = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024
    assert f"{sparse}:1: line longer than {MAX_JSONL_LINE_BYTES >> 20} MiB" in str(e.value)
    assert grew_mib < 64, grew_mib
    mixed = tmp_path / "mixed.jsonl"
    mixed.write_bytes(b'{"prompt": "1+1", "answer": "2"}\n{"prompt": "\xff\xfe", "answer": "3"}\n')
    with pytest.raises(DatasetError) as e:
        load_dataset(DatasetSpec(kind="jsonl", path=str(mixed)))
    assert str(e.value) == f"dataset {mixed}:2: not UTF-8 text"
    sep = tmp_path / "sep.jsonl"  # a line separator inside a JSON string is not a line break
    sep.write_text(json.dumps({"prompt": "a\u2028b", "answer": "1"}, ensure_ascii=False) + "\n", encoding="utf-8")
    assert [p.prompt for p in load_dataset(DatasetSpec(kind="jsonl", path=str(sep)))] == ["a\u2028b"]


def test_a_model_config_is_read_with_a_size_bound(tmp_path: Path, tiny_paths) -> None:
    assert read_config_json(tiny_paths["tiny-qwen3"] / "config.json")["model_type"] == "qwen3"
    model = tmp_path / "model"
    model.mkdir()
    with open(model / "config.json", "wb") as f:
        f.write(b'{"model_type": "qwen3", "pad": "')
        f.truncate(512 << 20)
    with pytest.raises(ValueError, match=f"larger than {MAX_CONFIG_BYTES >> 20} MiB"):
        read_config_json(model / "config.json")
    from onpolicy.models.loading import ModelLoadError, read_hf_dir

    with pytest.raises(ModelLoadError, match="not a model config"):
        read_hf_dir(model)
    from onpolicy.services.controller.controller import check_supported

    with pytest.raises(SpecError) as e:  # read inside SubmitJob for a parallel layout
        check_supported(parse_spec({"model": str(model), "parallel": {"trainer": {"tp": 2}}}))
    assert e.value.violations[0][0] == "model" and "larger than" in e.value.violations[0][1]
    assert os.path.getsize(model / "config.json") == 512 << 20


def test_cli_file_arguments_are_bounded_and_deep_json_is_one_line(tmp_path: Path, capsys) -> None:
    deep = tmp_path / "deep.json"
    deep.write_text("[" * 100_000)
    line = one_line_error(["diagnose", str(deep)], capsys)
    assert line.endswith(f"{deep}: not valid JSON (nested too deeply)"), line
    from onpolicy.cli.common import UsageError, read_file_arg

    token = tmp_path / "token"
    token.write_bytes(b"x" * (2 << 20))
    with pytest.raises(UsageError, match=r"--token-file .*: larger than 1 MiB"):
        read_file_arg(str(token), "--token-file", max_bytes=1 << 20)
    assert read_file_arg(str(token), "--token-file") == b"x" * (2 << 20)
