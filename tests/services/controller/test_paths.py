"""Server-side paths a spec names: under the controller's roots (``..`` and symlinks followed),
never a FIFO or a device — PERMISSION_DENIED or INVALID_ARGUMENT naming the field, over real gRPC."""

from __future__ import annotations

import os
import secrets
from pathlib import Path

import grpc
import pytest

from onpolicy.jobs.spec import JobSpec, parse_spec
from onpolicy.services import api
from onpolicy.services.common.client import connect, field_violations
from onpolicy.services.common.server import ServerConfig
from onpolicy.services.controller.convert import spec_to_proto
from onpolicy.services.controller.paths import PathRefused, PathRoots, check_paths

TOKEN = secrets.token_urlsafe(16)


def jsonl_spec(path: str, **over) -> JobSpec:
    return parse_spec({"model": "tiny-qwen3", "dataset": {"kind": "jsonl", "path": path}, **over})


@pytest.fixture
def tree(tmp_path: Path) -> dict[str, Path]:
    root, outside = tmp_path / "data", tmp_path / "elsewhere"
    root.mkdir()
    outside.mkdir()
    (root / "ok.jsonl").write_text('{"prompt": "1+1=", "answer": "2"}\n')
    (outside / "secret.jsonl").write_text("x\n")
    (root / "link.jsonl").symlink_to(outside / "secret.jsonl")
    os.mkfifo(root / "pipe.jsonl")
    return {"root": root, "outside": outside, "state": tmp_path / "state"}


def refused(spec: JobSpec, roots: PathRoots) -> PathRefused:
    with pytest.raises(PathRefused) as e:
        check_paths(spec, roots)
    return e.value


def test_paths_must_stay_under_the_roots(tree: dict[str, Path]) -> None:
    roots = PathRoots(data=[tree["root"]], models=[tree["root"]], state=tree["state"])
    check_paths(jsonl_spec(str(tree["root"] / "ok.jsonl")), roots)
    for path in (tree["outside"] / "secret.jsonl", tree["root"] / "link.jsonl",  # a symlink out of the root
                 tree["root"] / ".." / "elsewhere" / "secret.jsonl", Path("/etc/hostname")):
        e = refused(jsonl_spec(str(path)), roots)
        assert e.field == "dataset.path" and e.denied and "outside the roots" in str(e), path
    e = refused(jsonl_spec(str(tree["root"] / "ok.jsonl"), checkpoint={"dir": str(tree["outside"] / "ck")}), roots)
    assert e.field == "checkpoint.dir" and e.denied
    check_paths(jsonl_spec(str(tree["root"] / "ok.jsonl"), checkpoint={"dir": str(tree["state"] / "ck")}), roots)
    e = refused(parse_spec({"model": str(tree["outside"]), "dataset": {"kind": "arithmetic"}}), roots)
    assert e.field == "model" and e.denied


def test_special_files_are_refused_even_without_roots(tree: dict[str, Path]) -> None:
    for path in (tree["root"] / "pipe.jsonl", Path("/dev/null")):
        e = refused(jsonl_spec(str(path)), PathRoots())
        assert e.field == "dataset.path" and not e.denied and "not a regular file" in str(e)
    check_paths(jsonl_spec(str(tree["outside"] / "secret.jsonl")), PathRoots())  # no roots: anywhere


def test_submit_answers_permission_denied_and_invalid_argument(tree: dict[str, Path]) -> None:
    from onpolicy.services.cluster.actors import RayLauncher
    from onpolicy.services.controller.controller import JobController
    from onpolicy.services.controller.servicer import jobs_server

    controller = JobController(tree["state"], RayLauncher(token=TOKEN), data_roots=[tree["root"]])
    server = jobs_server(controller, ServerConfig(port=0, token=TOKEN))
    try:
        stub = api.jobs_pb2_grpc.JobServiceStub(connect(server.address, token=TOKEN))
        for path, code in ((tree["outside"] / "secret.jsonl", grpc.StatusCode.PERMISSION_DENIED),
                           (tree["root"] / "pipe.jsonl", grpc.StatusCode.INVALID_ARGUMENT)):
            with pytest.raises(grpc.RpcError) as e:
                stub.SubmitJob(api.jobs_pb2.SubmitJobRequest(spec=spec_to_proto(jsonl_spec(str(path)))), timeout=30)
            assert e.value.code() == code and "spec.dataset.path" in e.value.details()
            if code == grpc.StatusCode.INVALID_ARGUMENT:
                assert [f for f, _ in field_violations(e.value)] == ["spec.dataset.path"]
        assert controller.list() == []  # nothing was accepted
    finally:
        controller.shutdown()
        server.stop()
