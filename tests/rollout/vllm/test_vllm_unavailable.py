"""Where vLLM is not installed (simulated by hiding it from the import system): ``--engine vllm``
exits 2 with one line naming the missing package and the setup option, before any model is
loaded, and a JobService answers FAILED_PRECONDITION with that line. Also the engine names."""

from __future__ import annotations

import importlib.util

import pytest

from onpolicy.cli.main import main
from onpolicy.rollout.engines import ENGINES, EngineUnavailable, canonical, check_engine

_real_find_spec = importlib.util.find_spec


@pytest.fixture
def no_vllm(monkeypatch: pytest.MonkeyPatch) -> None:
    def find_spec(name: str, *args, **kwargs):
        if name.split(".")[0] in ("vllm", "vllm_ascend", "torch_npu"):
            return None
        return _real_find_spec(name, *args, **kwargs)

    monkeypatch.setattr(importlib.util, "find_spec", find_spec)


def test_engine_names() -> None:
    assert ENGINES == ("onpolicy", "vllm", "vllm-ascend")
    assert canonical("vllm-ascend") == "vllm" and canonical("onpolicy") == "onpolicy"
    with pytest.raises(ValueError, match="unknown rollout engine 'sglang'"):
        canonical("sglang")


def test_check_engine_names_the_package_and_the_setup_option(no_vllm) -> None:
    with pytest.raises(EngineUnavailable, match=r"needs vllm .*scripts/setup.sh --vllm"):
        check_engine("vllm")
    check_engine("onpolicy")


@pytest.mark.parametrize("argv", [
    ["serve", "rollout", "--engine", "vllm", "--model", "tiny-llama-hd32"],
    ["generate", "--engine", "vllm", "--model", "no-such-model", "--prompt", "hi"],
    ["consistency", "--engine", "vllm", "--model", "tiny-llama-hd32"],
    ["demo", "--engine", "vllm", "--model", "tiny-llama-hd32"],
])
def test_cli_exits_2_with_one_line(no_vllm, argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "needs vllm" in err[0] and "scripts/setup.sh --vllm" in err[0], err


def test_spec_engine_travels_in_the_proto_and_reaches_the_rollout_role_only() -> None:
    from onpolicy.jobs.spec import parse_spec
    from onpolicy.services.controller.convert import spec_from_proto, spec_to_proto
    from onpolicy.services.roles import ROLES, options_for

    spec = parse_spec({"model": "smollm2", "rollout": {"engine": "vllm", "kernels": "fast"}})
    msg = spec_to_proto(spec)
    assert msg.rollout.engine == "vllm" and spec_from_proto(msg) == spec
    opts = {role: options_for(spec, role) for role in ROLES}
    assert opts["rollout"].engine == "vllm" and opts["rollout"].kernels.backend == "fast"
    assert opts["trainer"].kernels.backend == opts["verifier"].kernels.backend == "reference"
    assert not hasattr(opts["trainer"], "engine") and not hasattr(opts["verifier"], "engine")


def test_submit_job_answers_failed_precondition(no_vllm, tmp_path) -> None:
    import grpc

    from onpolicy.jobs.spec import parse_spec
    from onpolicy.services import api
    from onpolicy.services.cluster.actors import RayLauncher
    from onpolicy.services.common.client import connect
    from onpolicy.services.common.server import ServerConfig
    from onpolicy.services.controller.controller import JobController
    from onpolicy.services.controller.convert import spec_to_proto
    from onpolicy.services.controller.servicer import jobs_server

    controller = JobController(tmp_path, RayLauncher(host="127.0.0.1"))  # role services would run here
    server = jobs_server(controller, ServerConfig(host="127.0.0.1", port=0))
    try:
        with connect(server.address) as channel:
            stub = api.jobs_pb2_grpc.JobServiceStub(channel)
            spec = spec_to_proto(parse_spec({"model": "tiny-llama-hd32", "rollout": {"engine": "vllm"}}))
            with pytest.raises(grpc.RpcError) as e:
                stub.SubmitJob(api.jobs_pb2.SubmitJobRequest(spec=spec), timeout=30)
            assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION
            assert "needs vllm" in e.value.details() and "scripts/setup.sh --vllm" in e.value.details()
            assert stub.ListJobs(api.jobs_pb2.ListJobsRequest(), timeout=30).jobs == []  # nothing was started
    finally:
        server.stop(grace=0)
        controller.shutdown()
