"""Security properties that hold across the code base: the bearer token is compared in constant
time (and health stays open), nothing deserialises pickles or runs code that came over the
network, and rewards come only from the registry. (TLS and mutual TLS with certificates generated
in the test: tests/services/common/test_grpc_plumbing.py; the token never logged nor stored over a real
job run with a restart: tests/services/controller/test_resume_bitwise.py.)"""

from __future__ import annotations

import ast
import hmac
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from onpolicy.jobs.rewards import REWARDS, RewardError, RewardInput, load_reward, total_reward
from onpolicy.jobs.spec import SpecError, parse_spec
from onpolicy.services import api
from onpolicy.services.common import auth
from onpolicy.services.common.client import connect
from onpolicy.services.common.server import GrpcServer, ServerConfig
from onpolicy.services.controller.controller import JobController
from onpolicy.services.controller.servicer import JobServicer

ROOT = Path(__file__).resolve().parents[3]
TOKEN = "security-test-token"
#: Code that serves or reads what arrives over the network (gRPC requests, files they name).
NETWORK_FACING = ("services", "onpolicy/jobs", "onpolicy/verification", "onpolicy/trainer", "onpolicy/rollout",
                  "onpolicy/weights.py", "onpolicy/models")
FORBIDDEN_MODULES = {"pickle", "cPickle", "dill", "cloudpickle", "marshal", "shelve", "joblib"}
FORBIDDEN_CALLS = {"eval", "exec", "compile", "__import__"}


def test_token_compare_is_constant_time_and_health_is_open(tmp_path: Path, monkeypatch) -> None:
    compared: list[tuple[bytes, bytes]] = []
    real = hmac.compare_digest

    def spy(a: bytes, b: bytes) -> bool:
        compared.append((a, b))
        return real(a, b)

    monkeypatch.setattr(auth.hmac, "compare_digest", spy)
    server = GrpcServer(ServerConfig(port=0, token=TOKEN))
    server.add_service("onpolicy.v1.JobService", JobServicer(JobController(tmp_path, launcher=None)),  # type: ignore[arg-type]
                       api.jobs_pb2_grpc.add_JobServiceServicer_to_server)
    server.start()
    try:
        for token, ok in ((TOKEN, True), ("x" + TOKEN[1:], False), (TOKEN + "x", False)):
            stub = api.jobs_pb2_grpc.JobServiceStub(connect(server.address, token=token))
            if ok:
                stub.ListJobs(api.jobs_pb2.ListJobsRequest(), timeout=10)
            else:
                with pytest.raises(grpc.RpcError) as e:
                    stub.ListJobs(api.jobs_pb2.ListJobsRequest(), timeout=10)
                assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED and token not in e.value.details()
            assert compared.pop() == (f"Bearer {token}".encode(), f"Bearer {TOKEN}".encode())
        with grpc.insecure_channel(server.address) as ch:  # no token at all: health answers, the rest refuses
            status = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=10).status
            assert status == health_pb2.HealthCheckResponse.SERVING
            with pytest.raises(grpc.RpcError) as e:
                api.jobs_pb2_grpc.JobServiceStub(ch).ListJobs(api.jobs_pb2.ListJobsRequest(), timeout=10)
            assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
    finally:
        server.stop(0)
    tree = ast.parse(Path(auth.__file__).read_text())
    compares = [n for n in ast.walk(tree) if isinstance(n, ast.Compare)
                and any(isinstance(op, ast.Eq | ast.NotEq) for op in n.ops)
                and "_expected" in ast.unparse(n)]
    assert not compares, "the token must only be compared with hmac.compare_digest"


def _python_files() -> list[Path]:
    files: list[Path] = []
    for entry in NETWORK_FACING:
        path = ROOT / entry
        files += [path] if path.is_file() else [f for f in sorted(path.rglob("*.py")) if "generated" not in f.parts]
    return files


def test_no_pickle_or_code_over_the_network() -> None:
    problems = []
    files = _python_files()
    assert len(files) > 30
    for f in files:
        tree = ast.parse(f.read_text())
        where = f.relative_to(ROOT)
        for node in ast.walk(tree):
            if isinstance(node, ast.Import | ast.ImportFrom):
                names = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]
                problems += [f"{where}:{node.lineno} imports {n}" for n in names
                             if n.split(".")[0] in FORBIDDEN_MODULES]
            elif isinstance(node, ast.Call):
                name = ast.unparse(node.func)
                if name in FORBIDDEN_CALLS:
                    problems.append(f"{where}:{node.lineno} calls {name}")
                if name.endswith("torch.load"):
                    safe = any(k.arg == "weights_only" and isinstance(k.value, ast.Constant) and k.value.value is True
                               for k in node.keywords)
                    if not safe:
                        problems.append(f"{where}:{node.lineno} torch.load without weights_only=True")
    assert not problems, problems
    # the wire format carries no opaque bytes that could hold a serialised object
    for proto in sorted((ROOT / "protos/onpolicy/v1").glob("*.proto")):
        lines = [line.strip() for line in proto.read_text().splitlines()]
        assert not [line for line in lines if line.startswith(("bytes ", "repeated bytes "))], proto


def test_rewards_come_only_from_the_registry_or_allowed_packages() -> None:
    assert {"exact_answer", "format", "length_penalty"} <= set(REWARDS)
    for name in ("os.system", "__import__('os').system('true')", "onpolicy.jobs.rewards.exact_answer", "lambda x: 1",
                 "EXACT_ANSWER", ""):
        with pytest.raises(SpecError) as e:
            parse_spec({"model": "tiny-qwen3", "rewards": [{"name": name}]})
        assert e.value.violations[0][0] == "rewards[0].name"
    assert [f.name for f in api.jobs_pb2.RewardSpec.DESCRIPTOR.fields] == ["name", "weight"]  # no code field
    x = RewardInput("1+1=", "2", "2", 1, 8)
    with pytest.raises(RewardError, match="unknown reward"):  # nothing is imported or evaluated
        total_reward([("os.system", 1.0)], x)
    # module:function passes the spec's form check, but is imported only from an allowed package
    parse_spec({"model": "tiny-qwen3", "rewards": [{"name": "os:system"}]})
    with pytest.raises(RewardError, match="package 'os' is not allowed on this controller"):
        load_reward("os:system")
    with pytest.raises(RewardError, match="not allowed"):
        load_reward("os:system", allowed_modules=["mypkg"])
