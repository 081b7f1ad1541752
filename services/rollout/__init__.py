"""The rollout service: ``RolloutService`` over gRPC on one rollout engine.

``build_rollout_service(model_ref, kernel_config, engine_config)`` -> ``RolloutServicer`` (refuses an
uncertified backend with ``UncertifiedBackend``); ``onpolicy.services.roles`` serves it.
"""

from onpolicy.services.common.model import UncertifiedBackend

from .service import build_rollout_service
from .servicer import RolloutServicer

__all__ = ["RolloutServicer", "UncertifiedBackend", "build_rollout_service"]
