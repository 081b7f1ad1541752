"""The rollout engine: paged KV cache, continuous batching, chunked prefill, prefix caching, and
per-request sampling — on the same model code and operator set as the trainer.

The names below are imported on first use, so ``onpolicy.rollout.names`` (engine names) loads
without torch."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .engine import EngineConfig, RolloutEngine
    from .sequence import Completion, SamplingParams

__all__ = ["Completion", "EngineConfig", "RolloutEngine", "SamplingParams"]
_HOMES = {"EngineConfig": "engine", "RolloutEngine": "engine", "Completion": "sequence", "SamplingParams": "sequence"}


def __getattr__(name: str) -> Any:
    if name not in _HOMES:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(f".{_HOMES[name]}", __name__), name)
