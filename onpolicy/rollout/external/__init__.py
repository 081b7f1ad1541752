"""Rollout engines other than our own, selected by the job spec's ``rollout.engine``.

``onpolicy`` (default) is ``onpolicy.rollout.RolloutEngine``; ``vllm-ascend`` is
``vllm_ascend.VllmAscendEngine`` (optional: its own extra and image). ``check_engine`` says whether
an engine can run here without importing it; ``build_engine`` builds one for the rollout service.
Importing this package never imports vllm, vllm_ascend or torch_npu.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from onpolicy.kernels import KernelConfig
from onpolicy.models.checkpoint import LoadedModel

from ..engine import EngineConfig
from .vllm_ascend import EngineUnavailable

OWN_ENGINE = "onpolicy"
ENGINES = (OWN_ENGINE, "vllm-ascend")


def check_engine(name: str) -> None:
    """Raise ``EngineUnavailable`` if engine ``name`` cannot run on this machine (``ValueError`` if
    there is no such engine)."""
    if name not in ENGINES:
        raise ValueError(f"unknown rollout engine {name!r}; engines are {list(ENGINES)}")
    if name == "vllm-ascend":
        from .vllm_ascend import require_available

        require_available()


def build_engine(name: str, model_ref: str, kernel_config: KernelConfig, config: EngineConfig | None = None, *,
                 certify: Callable[[KernelConfig, LoadedModel], None] | None = None) -> Any:
    """An external engine for the rollout service. Checked first, so a machine without it fails fast
    with ``EngineUnavailable`` before any model is loaded; ``certify(kernel_config, lm)`` runs on the
    CPU mirror of the model (its shapes) before the engine takes the NPU."""
    check_engine(name)
    if name == OWN_ENGINE:
        raise ValueError("the onpolicy engine is built by the rollout service itself")
    from .vllm_ascend import VllmAscendEngine, hf_directory, load_mirror

    hf_directory(model_ref)  # vLLM's format, checked before loading anything
    lm = load_mirror(model_ref, kernel_config)
    if certify is not None:
        certify(kernel_config, lm)
    return VllmAscendEngine(model_ref, kernel_config, config, lm=lm)


__all__ = ["ENGINES", "OWN_ENGINE", "EngineUnavailable", "build_engine", "check_engine"]
