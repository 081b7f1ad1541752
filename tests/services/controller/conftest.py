"""Fixtures of the service tests: the three role services of one tiny model on loopback."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from onpolicy.services import api
from onpolicy.services.common.client import connect
from onpolicy.services.controller.loop import RoleStubs
from onpolicy.services.roles import RoleOptions, start_role_server

TOKEN = "loop-test-token"


@pytest.fixture(scope="module")
def stubs() -> Iterator[RoleStubs]:
    """Stubs to a rollout, a trainer and a verifier service of ``tiny-qwen3`` (one set per module)."""
    opts = RoleOptions(model="tiny-qwen3", kv_tile=16)
    servers = {role: start_role_server(role, opts, token=TOKEN) for role in ("rollout", "trainer", "verifier")}
    ch = {role: connect(s.address, token=TOKEN) for role, s in servers.items()}
    yield RoleStubs(rollout=api.rollout_pb2_grpc.RolloutServiceStub(ch["rollout"]),
                    trainer=api.trainer_pb2_grpc.TrainerServiceStub(ch["trainer"]),
                    verifier=api.verifier_pb2_grpc.VerifierServiceStub(ch["verifier"]))
    for s in servers.values():
        s.stop(grace=0)
