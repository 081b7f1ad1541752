"""Fixtures of the service tests: the three role services of one tiny model on loopback."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from onpolicy.kernels import KernelConfig
from onpolicy.services import api
from onpolicy.services.common.client import connect
from onpolicy.services.controller.loop import RoleStubs
from onpolicy.services.roles import ROLES, start_role

TOKEN = "loop-test-token"
KV16 = KernelConfig(kv_tile=16)


@pytest.fixture(scope="module")
def stubs() -> Iterator[RoleStubs]:
    """Stubs to a rollout, a trainer and a verifier service of ``tiny-qwen3`` (one set per module)."""
    servers = {role: start_role(r.options(model="tiny-qwen3", kernels=KV16), token=TOKEN).server
               for role, r in ROLES.items()}
    ch = {role: connect(s.address, token=TOKEN) for role, s in servers.items()}
    yield RoleStubs(rollout=api.rollout_pb2_grpc.RolloutServiceStub(ch["rollout"]),
                    trainer=api.trainer_pb2_grpc.TrainerServiceStub(ch["trainer"]),
                    verifier=api.verifier_pb2_grpc.VerifierServiceStub(ch["verifier"]))
    for s in servers.values():
        s.stop(grace=0)
