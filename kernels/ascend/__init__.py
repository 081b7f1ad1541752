"""The ``ascend`` backend: the consistent operator set on Ascend NPUs.

Importing this package is safe on any machine: torch_npu, the CANN runtime and the compiled
operators are only touched when an :class:`AscendBackend` is constructed (or a function that says
so is called). See docs/ascend.md for building the Ascend C operators (kernels/ascendc) and what
was verified where. Placing services on NPUs (Ray resources, device visibility, Kubernetes
requests) is the runtime's: ``onpolicy.services.cluster.placement``.
"""

from .backend import AscendBackend
from .env import (
    DETERMINISTIC_ENV,
    apply_deterministic_env,
    configure_torch_npu,
    deterministic_env,
    env_mismatches,
)
from .marshal import attention_args, block_row_tiles
from .runtime import (
    UNAVAILABLE_MESSAGE,
    AscendUnavailable,
    Provider,
    ascend_available,
    detect_provider,
    torch_npu_installed,
)

__all__ = [
    "DETERMINISTIC_ENV",
    "UNAVAILABLE_MESSAGE",
    "AscendBackend",
    "AscendUnavailable",
    "Provider",
    "apply_deterministic_env",
    "ascend_available",
    "attention_args",
    "block_row_tiles",
    "configure_torch_npu",
    "detect_provider",
    "deterministic_env",
    "env_mismatches",
    "torch_npu_installed",
]
