"""The rollout engine: paged KV cache, continuous batching, chunked prefill, prefix caching, and
per-request sampling — on the same model code and operator set as the trainer."""

from .engine import EngineConfig, RolloutEngine
from .sequence import Completion, SamplingParams

__all__ = ["Completion", "EngineConfig", "RolloutEngine", "SamplingParams"]
