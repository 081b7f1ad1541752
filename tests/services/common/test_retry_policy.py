"""Retries of idempotent calls (``services/common/client.py``): a channel from ``connect`` sends an
idempotent call again when the service answers UNAVAILABLE, and never re-sends one that is not
(TrainStep, the negative control: the caller sees the UNAVAILABLE, and the server saw it once)."""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import grpc
import pytest

from onpolicy.services import api
from onpolicy.services.common.client import IDEMPOTENT_METHODS, RETRY_ATTEMPTS, connect


class _Flaky(api.trainer_pb2_grpc.TrainerServiceServicer):
    """Answers UNAVAILABLE to the first ``fail`` calls of each method, then serves."""

    def __init__(self, fail: int) -> None:
        self.fail, self.calls = fail, {"GetInfo": 0, "TrainStep": 0}

    def _serve(self, method: str, context: grpc.ServicerContext) -> None:
        self.calls[method] += 1
        if self.calls[method] <= self.fail:
            context.abort(grpc.StatusCode.UNAVAILABLE, "restarting")

    def GetInfo(self, request: Any, context: grpc.ServicerContext) -> Any:
        self._serve("GetInfo", context)
        return api.trainer_pb2.TrainerServiceGetInfoResponse(info=api.common_pb2.ServiceInfo(service="trainer"))

    def TrainStep(self, request: Any, context: grpc.ServicerContext) -> Any:
        self._serve("TrainStep", context)
        return api.trainer_pb2.TrainStepResponse()


def _serve(servicer: _Flaky) -> Iterator[grpc.Channel]:
    server = grpc.server(ThreadPoolExecutor(2))
    api.trainer_pb2_grpc.add_TrainerServiceServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    channel = connect(f"127.0.0.1:{port}")
    try:
        yield channel
    finally:
        channel.close()
        server.stop(grace=None)


@pytest.fixture
def flaky() -> Iterator[tuple[_Flaky, Any]]:
    servicer = _Flaky(fail=2)
    for channel in _serve(servicer):
        yield servicer, api.trainer_pb2_grpc.TrainerServiceStub(channel)


def test_an_idempotent_call_is_retried_through_unavailable(flaky) -> None:
    servicer, stub = flaky
    info = stub.GetInfo(api.trainer_pb2.TrainerServiceGetInfoRequest(), timeout=30).info
    assert info.service == "trainer" and servicer.calls["GetInfo"] == 3


def test_a_call_that_is_not_idempotent_is_sent_once(flaky) -> None:
    servicer, stub = flaky
    with pytest.raises(grpc.RpcError) as e:
        stub.TrainStep(api.trainer_pb2.TrainStepRequest(), timeout=30)
    assert e.value.code() is grpc.StatusCode.UNAVAILABLE and servicer.calls["TrainStep"] == 1


def test_retries_are_bounded() -> None:
    servicer = _Flaky(fail=100)
    for channel in _serve(servicer):
        with pytest.raises(grpc.RpcError) as e:
            api.trainer_pb2_grpc.TrainerServiceStub(channel).GetInfo(api.trainer_pb2.TrainerServiceGetInfoRequest(),
                                                                    timeout=60)
        assert e.value.code() is grpc.StatusCode.UNAVAILABLE and servicer.calls["GetInfo"] == RETRY_ATTEMPTS


def test_every_idempotent_method_exists() -> None:
    """gRPC ignores a service config naming a method that does not exist: a typo would silently drop
    its retries."""
    from grpc_health.v1 import health_pb2

    services = {s.full_name: s for m in (api.rollout_pb2, api.trainer_pb2, api.verifier_pb2, api.jobs_pb2, health_pb2)
                for s in m.DESCRIPTOR.services_by_name.values()}
    for service, methods in IDEMPOTENT_METHODS.items():
        assert service in services, service
        assert set(methods) <= set(services[service].methods_by_name), (service, methods)
