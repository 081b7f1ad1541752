"""The role services of a job — rollout, trainer, verifier — in one registry, ``ROLES``: for each its
typed options, how its servicer is built, the proto service it serves, its client stub and its
Prometheus registry. ``start_role`` is the one way to run a role (a Ray actor, ``onpolicy serve ROLE``
and the tests all call it); ``serve_servicer`` puts an already built servicer on a server.

Options are typed per role (``RolloutOptions``, ``TrainerOptions``, ``VerifierOptions``): frozen
dataclasses holding the domain's own configs (``KernelConfig``, ``EngineConfig``, ``VerifierConfig``),
derived from a ``JobSpec`` once, when a job's roles are launched (``options_for``), and handed to the
role's actor as they are.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any, ClassVar

from onpolicy.jobs.spec import JobSpec
from onpolicy.kernels import KernelConfig
from onpolicy.rollout.engine import EngineConfig
from onpolicy.rollout.speculative import SpeculativeConfig
from onpolicy.verification.config import VerifierConfig

from .cluster.placement import PeerPlacement
from .common.server import GrpcServer, ServerConfig


@dataclass(frozen=True, kw_only=True)
class RoleOptions:
    """What every role is started with."""

    role: ClassVar[str] = ""
    model: str
    kernels: KernelConfig = field(default_factory=KernelConfig)
    job: str = ""
    """The job the service runs for: the ``job`` label of its metrics, the name of its peer ranks
    ("" for a shared service)."""

    @property
    def peer_name(self) -> str:
        """The name prefix of the role's peer-rank actors ("" without a job)."""
        return f"onpolicy-{self.job}-{self.role}" if self.job else ""


@dataclass(frozen=True, kw_only=True)
class RolloutOptions(RoleOptions):
    role: ClassVar[str] = "rollout"
    engine: str = "onpolicy"
    """``onpolicy``, ``vllm`` or ``vllm-ascend`` (``onpolicy.rollout.engines``)."""
    engine_config: EngineConfig = field(default_factory=lambda: EngineConfig(max_num_seqs=64))
    weights_kernels: KernelConfig | None = None
    """The operators of the trainer whose weight versions this service accepts (None: its own; differs
    only for a deliberately mismatched rollout, e.g. fast kernels to exercise the verifier)."""
    tp: int = 1
    ep: int = 1
    peer_npus: int = 0
    """NPUs each tensor/expert-parallel peer rank requests."""
    peer_placement: PeerPlacement | None = None
    """Where the peer ranks go (the job's placement group; None: wherever Ray has room)."""

    @property
    def weights_fingerprint(self) -> str:
        return (self.weights_kernels or self.kernels).fingerprint


@dataclass(frozen=True, kw_only=True)
class TrainerOptions(RoleOptions):
    role: ClassVar[str] = "trainer"
    dp: int = 1
    tp: int = 1
    ep: int = 1
    peer_npus: int = 0
    """NPUs each peer rank (data, tensor or expert parallel) requests."""
    peer_placement: PeerPlacement | None = None
    """Where the peer ranks go (the job's placement group; None: wherever Ray has room)."""
    job_dir: str = ""
    """The job's own directory, the only place its RPCs may name ("" = not confined;
    ``services.trainer.confine``)."""


@dataclass(frozen=True, kw_only=True)
class VerifierOptions(RoleOptions):
    role: ClassVar[str] = "verifier"
    verifier: VerifierConfig = field(default_factory=VerifierConfig)


def _build_rollout(opts: RolloutOptions) -> Any:
    from .rollout.service import build_rollout_service

    return build_rollout_service(opts.model, opts.kernels, opts.engine_config,
                                 weights_fingerprint=opts.weights_fingerprint, engine=opts.engine, tp=opts.tp,
                                 ep=opts.ep, peer_npus=opts.peer_npus, peer_name=opts.peer_name,
                                 peer_placement=opts.peer_placement)


def _build_trainer(opts: TrainerOptions) -> Any:
    from .trainer.service import build_trainer_service

    return build_trainer_service(opts.model, opts.kernels, data_parallel=opts.dp, tp=opts.tp, ep=opts.ep,
                                 peer_npus=opts.peer_npus, peer_name=opts.peer_name, job_dir=opts.job_dir,
                                 job_id=opts.job, peer_placement=opts.peer_placement)


def _build_verifier(opts: VerifierOptions) -> Any:
    from .verifier.service import build_verifier_service

    return build_verifier_service(opts.model, opts.kernels, replace(opts.verifier, job=opts.job))


def _rollout_metrics(servicer: Any, job: str) -> Any:
    from .common.role_metrics import RolloutMetrics

    return RolloutMetrics(servicer, job).registry


def _trainer_metrics(servicer: Any, job: str) -> Any:
    from .common.role_metrics import TrainerMetrics

    return TrainerMetrics(servicer, job).registry


def _verifier_metrics(servicer: Any, job: str) -> Any:
    return servicer.metrics.registry  # the verifier's own VerifierMetrics, labelled with its config's job


@dataclass(frozen=True)
class Role:
    """One role service: its options type, how its servicer is built and exported, and its gRPC
    service (``service``: the proto service's name in ``api.SERVICE_NAMES``)."""

    name: str
    options: type[RoleOptions]
    service: str
    build: Callable[[Any], Any]
    metrics: Callable[[Any, str], Any]
    """``(servicer, job) -> CollectorRegistry``; called before the servicer is registered with a
    server (the trainer's metrics wrap its ``TrainStep``)."""

    @property
    def full_name(self) -> str:
        """The service's full name, as health checks and reflection know it."""
        from onpolicy.services import api

        return api.SERVICE_NAMES[self.service]

    def register(self, servicer: Any, server: Any) -> None:
        from onpolicy.services import api

        getattr(getattr(api, f"{self.name}_pb2_grpc"), f"add_{self.service}Servicer_to_server")(servicer, server)

    def stub(self, channel: Any) -> Any:
        from onpolicy.services import api

        return getattr(getattr(api, f"{self.name}_pb2_grpc"), f"{self.service}Stub")(channel)


ROLES: dict[str, Role] = {r.name: r for r in (
    Role("rollout", RolloutOptions, "RolloutService", _build_rollout, _rollout_metrics),
    Role("trainer", TrainerOptions, "TrainerService", _build_trainer, _trainer_metrics),
    Role("verifier", VerifierOptions, "VerifierService", _build_verifier, _verifier_metrics),
)}


def role_of(opts: RoleOptions) -> Role:
    if type(opts).role not in ROLES:
        raise TypeError(f"{type(opts).__name__} is not the options of a role ({', '.join(ROLES)})")
    return ROLES[type(opts).role]


def options_for(spec: JobSpec, role: str, job_id: str = "", job_dir: str = "", mismatch_dir: str = "",
                peers: PeerPlacement | None = None) -> RoleOptions:
    """The options of ``spec``'s ``role`` service: the job's model and operators (the rollout's own
    kernels where ``rollout.kernels: fast``), its engine, parallel degrees and the placement of its
    ``peers``, and for the trainer ``job_dir``, for the verifier ``mismatch_dir`` and the rollout's
    kernel fingerprint."""
    if role not in ROLES:
        raise ValueError(f"unknown role {role!r}; roles are {', '.join(ROLES)}")
    trainer_kernels = KernelConfig(backend=spec.kernels.backend, compute_dtype=spec.kernels.dtype,
                                   kv_tile=spec.kernels.kv_tile)
    common = {"model": spec.model, "kernels": trainer_kernels, "job": job_id}
    if role == "trainer":
        p = spec.parallel.trainer
        return TrainerOptions(**common, dp=p.dp, tp=p.tp, ep=p.ep, peer_npus=spec.resources_for("trainer").npus,
                              peer_placement=peers, job_dir=job_dir)
    rollout_kernels = trainer_kernels.with_(backend="fast") if spec.rollout.kernels == "fast" else trainer_kernels
    if role == "verifier":  # it records the rollout's kernels with the samples it stores
        return VerifierOptions(**common, verifier=VerifierConfig(
            mismatch_dir=mismatch_dir, rollout_kernel_fingerprint=rollout_kernels.fingerprint))
    r, p = spec.rollout, spec.parallel.rollout
    engine = EngineConfig(max_num_seqs=r.max_num_seqs, max_batched_tokens=r.max_batched_tokens,
                          speculative=SpeculativeConfig(method=r.speculative, num_tokens=r.num_speculative_tokens))
    return RolloutOptions(**{**common, "kernels": rollout_kernels}, engine=r.engine, engine_config=engine,
                          weights_kernels=trainer_kernels, tp=p.tp, ep=p.ep,
                          peer_npus=spec.resources_for("rollout").npus, peer_placement=peers)


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


def serve_servicer(role: str, servicer: Any, config: ServerConfig | None = None) -> GrpcServer:
    """A started ``GrpcServer`` (health, reflection, auth, TLS per ``config``) serving ``servicer`` as
    ``role``'s service; stopping the server closes the servicer."""
    r = ROLES[role]
    server = GrpcServer(config)
    server.add_service(r.full_name, servicer, r.register)  # type: ignore[arg-type]
    server.start()
    return server


def start_role(opts: RoleOptions, *, host: str = "127.0.0.1", port: int = 0, token: str | None = None,
               metrics_host: str | None = None, metrics_port: int = 0,
               server_config: ServerConfig | None = None) -> RoleServer:
    """Build the role service ``opts`` describes and start its gRPC server (``server_config``, e.g.
    with TLS, or one made of ``host``/``port``/``token``); with ``metrics_host`` also serve its
    ``/metrics`` there (``metrics_port`` 0 = a free port)."""
    r = role_of(opts)
    servicer = r.build(opts)
    registry = r.metrics(servicer, opts.job)
    server = serve_servicer(r.name, servicer, server_config or ServerConfig(host=host, port=port, token=token))
    endpoint = None
    if metrics_host is not None:
        from .common.metrics_endpoint import MetricsEndpoint

        try:
            endpoint = MetricsEndpoint(registry, metrics_host, metrics_port)
        except OSError:
            server.stop(grace=0)
            raise
    return RoleServer(server, servicer, endpoint)
