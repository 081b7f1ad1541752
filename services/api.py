"""The onpolicy.v1 gRPC API as Python modules: ``from onpolicy.services import api``, then
``api.rollout_pb2.GenerateRequest``, ``api.rollout_pb2_grpc.RolloutServiceStub`` ...

The modules are generated from ``protos/onpolicy/v1`` (see ``onpolicy.services.generated``).
``SERVICE_NAMES`` maps each service to its full name, as health checks and reflection know it.
"""

from __future__ import annotations

from onpolicy.services.generated.onpolicy.v1 import (
    common_pb2,
    common_pb2_grpc,
    jobs_pb2,
    jobs_pb2_grpc,
    rollout_pb2,
    rollout_pb2_grpc,
    trainer_pb2,
    trainer_pb2_grpc,
    verifier_pb2,
    verifier_pb2_grpc,
)

SERVICE_NAMES: dict[str, str] = {
    name: service.full_name
    for module in (rollout_pb2, trainer_pb2, verifier_pb2, jobs_pb2)
    for name, service in module.DESCRIPTOR.services_by_name.items()
}

__all__ = [
    "SERVICE_NAMES",
    "common_pb2",
    "common_pb2_grpc",
    "jobs_pb2",
    "jobs_pb2_grpc",
    "rollout_pb2",
    "rollout_pb2_grpc",
    "trainer_pb2",
    "trainer_pb2_grpc",
    "verifier_pb2",
    "verifier_pb2_grpc",
]
