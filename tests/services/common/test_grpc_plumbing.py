"""Shared gRPC plumbing on real servers (127.0.0.1, port 0) around a model-free fake servicer:
health, reflection, bearer-token auth, TLS / mutual TLS, message limits, error mapping, deadlines,
and the code generation behind ``onpolicy.services.api``."""

from __future__ import annotations

import filecmp
import re
import shutil
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase
from tls_support import certificates

import onpolicy.services.generated as generated
from onpolicy.services import api
from onpolicy.services.common import protogen
from onpolicy.services.common.auth import load_token
from onpolicy.services.common.client import connect, field_violations
from onpolicy.services.common.errors import FailedPrecondition, InvalidArgument, NotFound, ResourceExhausted
from onpolicy.services.common.server import GrpcServer, ServerConfig

pb = api.rollout_pb2
TOKEN = "s3cret-token-do-not-leak"
ROLLOUT = api.SERVICE_NAMES["RolloutService"]
ERRORS = {"not-found": NotFound("no such thing"), "precondition": FailedPrecondition("not now"),
          "exhausted": ResourceExhausted("too much"), "value": ValueError("plain value error"),
          "bug": RuntimeError(f"leaked {TOKEN}")}


class FakeRollout(api.rollout_pb2_grpc.RolloutServiceServicer):
    """Echoes prompts; ``text`` selects a failure; ``slow`` streams until the client goes away."""

    def __init__(self) -> None:
        self.saw_inactive = threading.Event()
        self.closed = False

    def close(self) -> None:
        self.closed = True

    def GetInfo(self, request: pb.RolloutServiceGetInfoRequest, context: grpc.ServicerContext,
                ) -> pb.RolloutServiceGetInfoResponse:
        return pb.RolloutServiceGetInfoResponse(info=api.common_pb2.ServiceInfo(service="fake"))

    def UpdateWeights(self, request: pb.UpdateWeightsRequest, context: grpc.ServicerContext,
                      ) -> pb.UpdateWeightsResponse:
        raise ERRORS[request.weights.path]

    def Generate(self, request: pb.GenerateRequest, context: grpc.ServicerContext) -> Iterator[pb.GenerateResponse]:
        for i, p in enumerate(request.prompts):
            if p.text == "slow":
                while context.is_active():
                    time.sleep(0.01)
                self.saw_inactive.set()
                return
            if p.text in ERRORS:
                raise ERRORS[p.text]
            if not p.prompt_ids:
                raise InvalidArgument(f"prompts[{i}].prompt_ids", "must not be empty")
            yield pb.GenerateResponse(completion=api.common_pb2.Completion(prompt_index=i, token_ids=p.prompt_ids))


def start(**config: object) -> tuple[GrpcServer, FakeRollout]:
    fake = FakeRollout()
    server = GrpcServer(ServerConfig(**config))  # type: ignore[arg-type]
    server.add_service(ROLLOUT, fake, api.rollout_pb2_grpc.add_RolloutServiceServicer_to_server)
    server.start()
    return server, fake


@pytest.fixture(scope="module")
def authed() -> Iterator[GrpcServer]:
    server, _ = start(token=TOKEN, max_message_bytes=64 << 10)
    yield server
    server.stop(0)


def stub(channel: grpc.Channel) -> api.rollout_pb2_grpc.RolloutServiceStub:
    return api.rollout_pb2_grpc.RolloutServiceStub(channel)


def generate(channel: grpc.Channel, *prompts: pb.Prompt, timeout: float = 10) -> list[pb.GenerateResponse]:
    return list(stub(channel).Generate(pb.GenerateRequest(prompts=prompts), timeout=timeout))


def rpc_error(fn: object, *args: object, **kwargs: object) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as info:
        fn(*args, **kwargs)  # type: ignore[operator]
    return info.value


def test_health_answers_serving_without_a_token(authed: GrpcServer) -> None:
    with grpc.insecure_channel(authed.address) as ch:
        health = health_pb2_grpc.HealthStub(ch)
        for service in ("", ROLLOUT):
            reply = health.Check(health_pb2.HealthCheckRequest(service=service), timeout=5)
            assert reply.status == health_pb2.HealthCheckResponse.SERVING
        err = rpc_error(health.Check, health_pb2.HealthCheckRequest(service="nope.Service"), timeout=5)
        assert err.code() == grpc.StatusCode.NOT_FOUND


def test_reflection_lists_the_services_without_a_token(authed: GrpcServer) -> None:
    with grpc.insecure_channel(authed.address) as ch:
        services = set(ProtoReflectionDescriptorDatabase(ch).get_services())
    assert services == {ROLLOUT, "grpc.health.v1.Health", "grpc.reflection.v1alpha.ServerReflection"}


@pytest.mark.parametrize("token", [None, "wrong-token", TOKEN + "x", ""])
def test_every_rpc_needs_the_right_token(authed: GrpcServer, token: str | None) -> None:
    with grpc.insecure_channel(authed.address) as ch:
        s = stub(ch)
        metadata = None if token is None else [("authorization", f"Bearer {token}")]
        calls = [lambda: s.GetInfo(pb.RolloutServiceGetInfoRequest(), metadata=metadata, timeout=5),
                 lambda: s.UpdateWeights(pb.UpdateWeightsRequest(), metadata=metadata, timeout=5),
                 lambda: list(s.Generate(pb.GenerateRequest(prompts=[pb.Prompt(prompt_ids=[1])]), metadata=metadata,
                                         timeout=5)),
                 lambda: ch.unary_unary("/onpolicy.v1.RolloutService/NoSuchMethod")(b"", metadata=metadata, timeout=5)]
        for call in calls:
            err = rpc_error(call)
            assert err.code() == grpc.StatusCode.UNAUTHENTICATED
            assert TOKEN not in (err.details() or "")


def test_right_token_works_and_token_stays_out_of_reprs(authed: GrpcServer) -> None:
    with connect(authed.address, token=TOKEN) as ch:
        assert stub(ch).GetInfo(pb.RolloutServiceGetInfoRequest(), timeout=5).info.service == "fake"
        assert [r.completion.token_ids for r in generate(ch, pb.Prompt(prompt_ids=[3, 4]))] == [[3, 4]]
    assert TOKEN not in repr(authed.config)


def test_token_is_not_sent_in_plaintext_beyond_loopback() -> None:
    with pytest.raises(ValueError, match="plaintext"):
        connect("10.1.2.3:50051", token=TOKEN)
    connect("10.1.2.3:50051", token=TOKEN, allow_insecure_token=True).close()


def test_load_token(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("ONPOLICY_TOKEN", raising=False)
    assert load_token() is None
    monkeypatch.setenv("ONPOLICY_TOKEN", " from-env\n")
    assert load_token() == "from-env"
    (tmp_path / "token").write_text("from-file\n")
    assert load_token(tmp_path / "token") == "from-file"
    (tmp_path / "empty").write_text("\n")
    with pytest.raises(ValueError):
        load_token(tmp_path / "empty")


def test_oversized_message_is_resource_exhausted(authed: GrpcServer) -> None:
    with connect(authed.address, token=TOKEN) as ch:  # the client allows 64 MiB, the server 64 KiB
        err = rpc_error(generate, ch, pb.Prompt(prompt_ids=list(range(100_000))))
    assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED


def test_domain_errors_map_to_status_codes(authed: GrpcServer) -> None:
    with connect(authed.address, token=TOKEN) as ch:
        err = rpc_error(generate, ch, pb.Prompt(prompt_ids=[1]), pb.Prompt())
        assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert field_violations(err) == [("prompts[1].prompt_ids", "must not be empty")]
        expected = {"not-found": grpc.StatusCode.NOT_FOUND, "precondition": grpc.StatusCode.FAILED_PRECONDITION,
                    "exhausted": grpc.StatusCode.RESOURCE_EXHAUSTED, "value": grpc.StatusCode.INVALID_ARGUMENT,
                    "bug": grpc.StatusCode.INTERNAL}
        for name, code in expected.items():
            for err in (rpc_error(generate, ch, pb.Prompt(text=name)),  # streaming handler
                        rpc_error(stub(ch).UpdateWeights, pb.UpdateWeightsRequest(  # unary handler
                            weights=api.common_pb2.WeightsRef(path=name)), timeout=5)):
                assert err.code() == code, name
                assert field_violations(err) == []
                if name == "bug":
                    assert TOKEN not in err.details() and err.details().startswith("internal error ")
                else:
                    assert err.details() == str(ERRORS[name])


def test_deadline_ends_a_streaming_call_on_the_server() -> None:
    server, fake = start()
    try:
        with connect(server.address) as ch:
            err = rpc_error(generate, ch, pb.Prompt(text="slow"), timeout=0.3)
            assert err.code() == grpc.StatusCode.DEADLINE_EXCEEDED
            assert fake.saw_inactive.wait(5)
    finally:
        server.stop(0)
    assert fake.closed


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return certificates(tmp_path_factory.mktemp("certs"))


def _info(ch: grpc.Channel) -> str:
    return stub(ch).GetInfo(pb.RolloutServiceGetInfoRequest(), timeout=5).info.service


def test_tls_with_token(certs: dict[str, Path]) -> None:
    server, _ = start(token=TOKEN, tls_cert=str(certs["server_cert"]), tls_key=str(certs["server_key"]))
    try:
        with connect(server.address, token=TOKEN, tls_ca=certs["ca_cert"]) as ch:
            assert _info(ch) == "fake"
        with connect(server.address, tls_ca=certs["ca_cert"]) as ch:
            assert rpc_error(_info, ch).code() == grpc.StatusCode.UNAUTHENTICATED
        with connect(server.address, token=TOKEN, tls_ca=certs["client_cert"]) as ch:  # wrong trust root
            assert rpc_error(_info, ch).code() == grpc.StatusCode.UNAVAILABLE
        with grpc.insecure_channel(server.address) as ch:  # plaintext to a TLS port
            assert rpc_error(_info, ch).code() == grpc.StatusCode.UNAVAILABLE
    finally:
        server.stop(0)


def test_mutual_tls(certs: dict[str, Path]) -> None:
    server, _ = start(tls_cert=str(certs["server_cert"]), tls_key=str(certs["server_key"]),
                      tls_client_ca=str(certs["ca_cert"]))
    try:
        with connect(server.address, tls_ca=certs["ca_cert"], client_cert=certs["client_cert"],
                     client_key=certs["client_key"]) as ch:
            assert _info(ch) == "fake"
        with connect(server.address, tls_ca=certs["ca_cert"]) as ch:  # no client certificate
            assert rpc_error(_info, ch).code() == grpc.StatusCode.UNAVAILABLE
    finally:
        server.stop(0)


def test_server_config_validation() -> None:
    for bad in (dict(tls_cert="c.pem"), dict(tls_client_ca="ca.pem"), dict(port=70000), dict(token=" ")):
        with pytest.raises(ValueError):
            ServerConfig(**bad)  # type: ignore[arg-type]


def test_codegen_reproduces_the_package_modules(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The build hook and ``python -m onpolicy.services.common.protogen`` share ``protogen``: generating
    afresh gives the modules the package imports, with relative imports; an edited .proto makes them
    stale, and importing stale modules fails naming the command."""
    assert protogen.is_current(generated.PROTO_ROOT, generated.OUT_ROOT)
    protos = tmp_path / "protos"
    shutil.copytree(generated.PROTO_ROOT, protos)
    written = protogen.generate(protos, tmp_path / "out")
    assert sorted(p.name for p in written if p.suffix == ".py") == sorted(protogen.expected_modules(protos))
    pkg = generated.OUT_ROOT / protogen.PACKAGE_DIR
    for p in written:
        assert filecmp.cmp(p, pkg / p.name, shallow=False), p.name
        assert "from onpolicy.v1 import" not in p.read_text()
    assert "from . import common_pb2" in (pkg / "rollout_pb2.py").read_text()
    assert protogen.generate(protos, tmp_path / "out") == []  # up to date: nothing rewritten
    with open(protos / protogen.PACKAGE_DIR / "common.proto", "a") as f:
        f.write("// edited\n")
    assert not protogen.is_current(protos, tmp_path / "out")
    monkeypatch.setattr(generated, "PROTO_ROOT", protos)  # a checkout whose .proto changed since the build
    monkeypatch.setattr(generated, "OUT_ROOT", tmp_path / "out")
    with pytest.raises(ImportError, match=re.escape(generated.REGENERATE)):
        generated.check()
