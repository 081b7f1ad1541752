"""Start one role's gRPC server (rollout, trainer or verifier) from plain options — what a Ray
actor, ``onpolicy serve ROLE`` or a pod runs — and, when asked, its Prometheus ``/metrics``
endpoint (``role_metrics_registry``: one registry per service, see ``services.common.metrics_endpoint``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

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
    speculative: str = "none"
    """Rollout: speculative decoding, ``none`` or ``ngram`` (``onpolicy.rollout.speculative``)."""
    num_speculative_tokens: int = 4
    """Rollout: most drafted tokens per request and decode step."""
    weights_fingerprint_backend: str = "reference"
    """Backend of the trainer whose weight versions this service accepts (differs from ``backend``
    only for a deliberately mismatched rollout, e.g. fast kernels to exercise the verifier)."""
    job: str = ""
    """Job the service runs for: the ``job`` label of its metrics ("" for a shared service)."""
    job_dir: str = ""
    """Trainer: the job's own directory, the only place its RPCs may name ("" = not confined;
    ``services.trainer.confine``)."""
    verifier_max_samples_per_second: float = 0.0
    """Verifier: per-job cap on samples verified per second (0 = no cap)."""
    verifier_queue_samples: int = 1024
    """Verifier: capacity of the asynchronous queue, in samples."""
    mismatch_dir: str = ""
    """Verifier: mismatch store directory (default ``$ONPOLICY_HOME/mismatches``)."""
    mismatch_keep: int = 16
    """Verifier: worst mismatching samples kept per job."""
    rollout_kernel_fingerprint: str = ""
    """Verifier: kernel fingerprint of the job's rollout, recorded for its samples that carry none."""
    engine: str = "onpolicy"
    """Rollout: ``onpolicy`` or ``vllm`` (``onpolicy.rollout.engines``)."""
    rollout_tp: int = 1
    """Rollout: tensor-parallel degree (``onpolicy.parallel.mirrored``: peer ranks are Ray actors it starts)."""
    rollout_ep: int = 1
    """Rollout: expert-parallel degree (MoE models)."""
    rollout_npus: int = 0
    """Rollout: NPUs each tensor/expert-parallel peer requests (as many as the rollout itself)."""
    trainer_dp: int = 1
    """Trainer: data-parallel ranks; the service is rank 0, its peers are Ray actors it starts
    (``onpolicy.trainer.data_parallel``)."""
    trainer_tp: int = 1
    """Trainer: tensor-parallel degree (``onpolicy.trainer.model_parallel``; not with ``trainer_dp`` > 1)."""
    trainer_ep: int = 1
    """Trainer: expert-parallel degree (MoE models)."""
    trainer_dp_npus: int = 0
    """Trainer: NPUs each peer rank (data, tensor or expert parallel) requests (as many as the trainer itself)."""

    @property
    def kernel_config(self) -> KernelConfig:
        return KernelConfig(backend=self.backend, compute_dtype=self.dtype, kv_tile=self.kv_tile)  # type: ignore[arg-type]

    @property
    def weights_fingerprint(self) -> str:
        return self.kernel_config.with_(backend=self.weights_fingerprint_backend).fingerprint

    @property
    def verifier_config(self) -> Any:
        from onpolicy.verification.config import VerifierConfig

        return VerifierConfig(job=self.job, max_samples_per_second=self.verifier_max_samples_per_second,
                              queue_samples=self.verifier_queue_samples, mismatch_dir=self.mismatch_dir,
                              mismatch_keep=self.mismatch_keep,
                              rollout_kernel_fingerprint=self.rollout_kernel_fingerprint)


SERVICE_NAMES = {"rollout": "onpolicy.v1.RolloutService", "trainer": "onpolicy.v1.TrainerService",
                 "verifier": "onpolicy.v1.VerifierService", "jobs": "onpolicy.v1.JobService"}


def build_role_servicer(role: str, opts: RoleOptions) -> tuple[object, object]:
    """The servicer of ``role`` and its generated ``add_*_to_server`` registrar."""
    from onpolicy.services import api

    if role == "rollout":
        from onpolicy.rollout import EngineConfig
        from onpolicy.rollout.speculative import SpeculativeConfig

        from .rollout.service import build_rollout_service

        spec = SpeculativeConfig(method=opts.speculative, num_tokens=opts.num_speculative_tokens)
        servicer = build_rollout_service(opts.model, opts.kernel_config,
                                         EngineConfig(max_num_seqs=opts.max_num_seqs,
                                                      max_batched_tokens=opts.max_batched_tokens, speculative=spec),
                                         weights_fingerprint=opts.weights_fingerprint, engine=opts.engine,
                                         tp=opts.rollout_tp, ep=opts.rollout_ep, peer_npus=opts.rollout_npus,
                                         peer_name=f"onpolicy-{opts.job}-rollout" if opts.job else "")
        return servicer, api.rollout_pb2_grpc.add_RolloutServiceServicer_to_server
    if role == "trainer":
        from .trainer.service import build_trainer_service

        servicer = build_trainer_service(opts.model, opts.kernel_config, data_parallel=opts.trainer_dp,
                                         tp=opts.trainer_tp, ep=opts.trainer_ep, peer_npus=opts.trainer_dp_npus,
                                         peer_name=f"onpolicy-{opts.job}-trainer" if opts.job else "",
                                         job_dir=opts.job_dir, job_id=opts.job)
        return servicer, api.trainer_pb2_grpc.add_TrainerServiceServicer_to_server
    if role == "verifier":
        from .verifier.service import build_verifier_service

        servicer = build_verifier_service(opts.model, opts.kernel_config, opts.verifier_config)
        return servicer, api.verifier_pb2_grpc.add_VerifierServiceServicer_to_server
    raise ValueError(f"unknown role {role!r}; roles are rollout, trainer, verifier")


def role_metrics_registry(role: str, servicer: Any, job: str = "") -> Any:
    """The ``CollectorRegistry`` of a role's servicer (call before registering the servicer with a
    gRPC server: the trainer's metrics wrap its ``TrainStep``)."""
    if role == "verifier":
        return servicer.metrics.registry
    from .common.role_metrics import RolloutMetrics, TrainerMetrics

    if role == "rollout":
        return RolloutMetrics(servicer, job).registry
    if role == "trainer":
        return TrainerMetrics(servicer, job).registry
    raise ValueError(f"unknown role {role!r}; roles are rollout, trainer, verifier")


@dataclass
class RoleServer:
    """A started role: its gRPC server and, when asked for, its metrics endpoint."""

    server: GrpcServer
    servicer: Any
    metrics: Any = None
    """``services.common.metrics_endpoint.MetricsEndpoint`` or None."""

    def stop(self, grace: float | None = None) -> None:
        if self.metrics is not None:
            self.metrics.close()
        self.server.stop(grace)


def start_role(role: str, opts: RoleOptions, *, host: str = "127.0.0.1", port: int = 0, token: str | None = None,
               metrics_host: str | None = None, metrics_port: int = 0,
               server_config: ServerConfig | None = None) -> RoleServer:
    """Build and start ``role``'s gRPC server (``server_config``, e.g. with TLS, or one made of
    ``host``/``port``/``token``); with ``metrics_host`` also serve its ``/metrics`` there
    (``metrics_port`` 0 = a free port)."""
    servicer, register = build_role_servicer(role, opts)
    registry = role_metrics_registry(role, servicer, opts.job)
    server = GrpcServer(server_config or ServerConfig(host=host, port=port, token=token))
    server.add_service(SERVICE_NAMES[role], servicer, register)  # type: ignore[arg-type]
    server.start()
    endpoint = None
    if metrics_host is not None:
        from .common.metrics_endpoint import MetricsEndpoint

        try:
            endpoint = MetricsEndpoint(registry, metrics_host, metrics_port)
        except OSError:
            server.stop(grace=0)
            raise
    return RoleServer(server, servicer, endpoint)


def start_role_server(role: str, opts: RoleOptions, *, host: str = "127.0.0.1", port: int = 0,
                      token: str | None = None) -> GrpcServer:
    return start_role(role, opts, host=host, port=port, token=token).server
