"""Building and serving the rollout service: load the model on a backend certified on this machine
(``onpolicy.services.common.model``), wrap a fresh engine in a ``RolloutServicer`` and put it on a
``GrpcServer``."""

from __future__ import annotations

from onpolicy.kernels import KernelConfig
from onpolicy.rollout import EngineConfig, RolloutEngine
from onpolicy.rollout.external import OWN_ENGINE, build_engine
from onpolicy.services.common.model import ensure_certified, load_certified
from onpolicy.services.common.server import GrpcServer, ServerConfig

from .servicer import SERVICE_NAME, RolloutServicer


def build_rollout_service(model_ref: str, kernel_config: KernelConfig, engine_config: EngineConfig | None = None,
                          *, weights_fingerprint: str | None = None, max_sequences_per_request: int = 4096,
                          engine: str = OWN_ENGINE) -> RolloutServicer:
    """Load ``model_ref`` on ``kernel_config``'s backend and wrap a fresh engine in a servicer.

    Refuses (``UncertifiedBackend``) when the backend fails its self-test on this machine (run once
    for the model's shapes when no certificate exists). ``weights_fingerprint`` is the kernel
    fingerprint weight versions must carry to be accepted by UpdateWeights (default: this service's
    own); set it only to run ``fast`` kernels on weights the consistent trainer publishes.
    ``engine``: ``onpolicy`` or an external engine (``onpolicy.rollout.external``, e.g. ``vllm-ascend``).
    """
    if engine != OWN_ENGINE:  # e.g. vllm-ascend: EngineUnavailable (FAILED_PRECONDITION) before loading anything
        external = build_engine(engine, model_ref, kernel_config, engine_config, certify=ensure_certified)
        return RolloutServicer(external, weights_fingerprint=weights_fingerprint,
                               max_sequences_per_request=max_sequences_per_request)
    lm = load_certified(model_ref, kernel_config)
    return RolloutServicer(RolloutEngine(lm, engine_config), weights_fingerprint=weights_fingerprint,
                           max_sequences_per_request=max_sequences_per_request)


def serve_rollout(servicer: RolloutServicer, config: ServerConfig | None = None) -> GrpcServer:
    """Start a ``GrpcServer`` for ``servicer`` (health, reflection, auth, TLS per ``config``);
    stopping the server closes the servicer."""
    server = GrpcServer(config)
    server.add_service(SERVICE_NAME, servicer, RolloutServicer.register)
    server.start()
    return server
