"""The ``ascend`` backend: the consistent operator set on Ascend NPUs.

Importing this package is safe on any machine: torch_npu, the CANN runtime and the compiled
operators are only touched when an :class:`AscendBackend` is constructed (or a function that says
so is called). See docs/ascend.md for building the Ascend C operators (kernels/ascendc) and what
was verified where.
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
from .placement import (
    K8S_NPU_RESOURCE,
    NPU_RESOURCE,
    VISIBLE_DEVICES_ENV,
    actor_options,
    assigned_npu_ids,
    k8s_resources,
    local_device,
    parse_visible_devices,
    ray_resources,
    ray_start_params,
    visible_devices_env,
)
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
    "K8S_NPU_RESOURCE",
    "NPU_RESOURCE",
    "UNAVAILABLE_MESSAGE",
    "VISIBLE_DEVICES_ENV",
    "AscendBackend",
    "AscendUnavailable",
    "Provider",
    "actor_options",
    "apply_deterministic_env",
    "ascend_available",
    "assigned_npu_ids",
    "attention_args",
    "block_row_tiles",
    "configure_torch_npu",
    "detect_provider",
    "deterministic_env",
    "env_mismatches",
    "k8s_resources",
    "local_device",
    "parse_visible_devices",
    "ray_resources",
    "ray_start_params",
    "torch_npu_installed",
    "visible_devices_env",
]
