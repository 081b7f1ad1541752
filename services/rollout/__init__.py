"""The rollout service: ``RolloutService`` over gRPC on one ``RolloutEngine``.

``build_rollout_service(model_ref, kernel_config, engine_config)`` -> ``RolloutServicer`` (refuses an
uncertified backend with ``UncertifiedBackend``), ``serve_rollout(servicer, server_config)`` -> a
started ``GrpcServer``.
"""

from onpolicy.services.common.model import UncertifiedBackend

from .service import build_rollout_service, serve_rollout
from .servicer import SERVICE_NAME, RolloutServicer

__all__ = ["SERVICE_NAME", "RolloutServicer", "UncertifiedBackend", "build_rollout_service", "serve_rollout"]
