"""The deterministic environment of the Ascend backend.

Environment variables must be in place before torch_npu initialises HCCL/LCCL, so services call
:func:`apply_deterministic_env` first thing (the backend also calls it when it is constructed).
Runtime switches that need torch_npu are applied by :func:`configure_torch_npu`. Nothing here
imports torch_npu at module import time.
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import MutableMapping

#: Variables and the values the consistent operator set needs.
DETERMINISTIC_ENV: dict[str, str] = {
    # Reduction collectives (AllReduce, ReduceScatter, ...) deterministic AND order preserving on
    # Atlas A2; on A3 "strict" behaves like "true". Needs INF/NaN mode (below).
    "HCCL_DETERMINISTIC": "strict",
    # LCCL (the lightweight intra-node collectives used by ATB / vllm-ascend): deterministic.
    "LCCL_DETERMINISTIC": "1",
    # IEEE inf/NaN instead of saturation: masked scores are -inf before the row max and exactly
    # 0 after exp; required by HCCL_DETERMINISTIC=strict.
    "INF_NAN_MODE_ENABLE": "1",
    # vllm-ascend: keep weights in ND format (no FRACTAL_NZ re-layout of matmul weights).
    "VLLM_ASCEND_ENABLE_NZ": "0",
}


def deterministic_env() -> dict[str, str]:
    """A copy of the environment variables the Ascend backend requires."""
    return dict(DETERMINISTIC_ENV)


def apply_deterministic_env(environ: MutableMapping[str, str] | None = None) -> dict[str, str | None]:
    """Set the deterministic variables in ``environ`` (default ``os.environ``), overriding any
    other value; returns the previous values (``None`` where unset) so callers can restore them."""
    target = os.environ if environ is None else environ
    previous: dict[str, str | None] = {}
    for key, value in DETERMINISTIC_ENV.items():
        previous[key] = target.get(key)
        target[key] = value
    return previous


def env_mismatches(environ: MutableMapping[str, str] | None = None) -> dict[str, tuple[str | None, str]]:
    """Variables whose current value differs from the required one: ``{name: (current, required)}``."""
    source = os.environ if environ is None else environ
    return {k: (source.get(k), v) for k, v in DETERMINISTIC_ENV.items() if source.get(k) != v}


def configure_torch_npu() -> dict[str, object]:
    """Runtime switches of torch_npu (imports it; call only on an NPU machine):
    internal (NZ) formats off, HF32 off for matmul and convolution, deterministic algorithms on
    (torch_npu maps it to deterministic aclnn kernels). Returns what was set."""
    if importlib.util.find_spec("torch_npu") is None:
        raise RuntimeError("configure_torch_npu needs torch_npu")
    import torch
    import torch_npu

    torch_npu.npu.config.allow_internal_format = False
    torch.npu.matmul.allow_hf32 = False
    torch.npu.conv.allow_hf32 = False
    torch.use_deterministic_algorithms(True, warn_only=True)
    return {"allow_internal_format": False, "matmul.allow_hf32": False, "conv.allow_hf32": False,
            "deterministic_algorithms": True}
