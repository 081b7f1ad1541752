"""Start one role's gRPC server (rollout, trainer or verifier) from plain options — what a Ray
actor, ``onpolicy serve ROLE`` or a pod runs."""

from __future__ import annotations

from dataclasses import dataclass

from onpolicy.kernels import KernelConfig

from .common.server import GrpcServer, ServerConfig


@dataclass(frozen=True, kw_only=True)
class RoleOptions:
    model: str
    backend: str = "reference"
    dtype: str = "fp32"
    kv_tile: int = 64
    max_num_seqs: int = 64
    max_batched_tokens: int = 2048
    weights_fingerprint_backend: str = "reference"
    """Backend of the trainer whose weight versions this service accepts (differs from ``backend``
    only for a deliberately mismatched rollout, e.g. fast kernels to exercise the verifier)."""

    @property
    def kernel_config(self) -> KernelConfig:
        return KernelConfig(backend=self.backend, compute_dtype=self.dtype, kv_tile=self.kv_tile)  # type: ignore[arg-type]

    @property
    def weights_fingerprint(self) -> str:
        return self.kernel_config.with_(backend=self.weights_fingerprint_backend).fingerprint


SERVICE_NAMES = {"rollout": "onpolicy.v1.RolloutService", "trainer": "onpolicy.v1.TrainerService",
                 "verifier": "onpolicy.v1.VerifierService", "jobs": "onpolicy.v1.JobService"}


def build_role_servicer(role: str, opts: RoleOptions) -> tuple[object, object]:
    """The servicer of ``role`` and its generated ``add_*_to_server`` registrar."""
    from onpolicy.services import api

    if role == "rollout":
        from onpolicy.rollout import EngineConfig

        from .rollout.service import build_rollout_service

        servicer = build_rollout_service(opts.model, opts.kernel_config,
                                         EngineConfig(max_num_seqs=opts.max_num_seqs,
                                                      max_batched_tokens=opts.max_batched_tokens),
                                         weights_fingerprint=opts.weights_fingerprint)
        return servicer, api.rollout_pb2_grpc.add_RolloutServiceServicer_to_server
    if role == "trainer":
        from .trainer.service import build_trainer_service

        servicer = build_trainer_service(opts.model, opts.kernel_config)
        return servicer, api.trainer_pb2_grpc.add_TrainerServiceServicer_to_server
    if role == "verifier":
        from .verifier.service import build_verifier_service

        servicer = build_verifier_service(opts.model, opts.kernel_config)
        return servicer, api.verifier_pb2_grpc.add_VerifierServiceServicer_to_server
    raise ValueError(f"unknown role {role!r}; roles are rollout, trainer, verifier")


def start_role_server(role: str, opts: RoleOptions, *, host: str = "127.0.0.1", port: int = 0,
                      token: str | None = None) -> GrpcServer:
    servicer, register = build_role_servicer(role, opts)
    server = GrpcServer(ServerConfig(host=host, port=port, token=token))
    server.add_service(SERVICE_NAMES[role], servicer, register)  # type: ignore[arg-type]
    server.start()
    return server
