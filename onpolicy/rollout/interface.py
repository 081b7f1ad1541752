"""The rollout-engine interface: what the rollout service, the CLI and the consistency checks drive,
implemented by our ``RolloutEngine`` and by ``onpolicy.rollout.vllm.VllmEngine``.

``Engine`` is the protocol; ``EngineSnapshot`` the ``stats()`` snapshot the metrics and the
servicer read (instead of an engine's internals); ``validate_request`` the request checks every
engine makes before queueing.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Protocol

import torch

from onpolicy.kernels import KernelConfig
from onpolicy.models.config import ModelConfig
from onpolicy.models.loading import LoadedModel

from .sequence import Completion, SamplingParams


@dataclass(frozen=True)
class EngineSnapshot:
    """Counters since the engine started and gauges of now."""

    steps: int = 0
    tokens_computed: int = 0
    """Token rows computed (prefill + decode)."""
    tokens_generated: int = 0
    seconds: float = 0.0
    """Time spent in engine steps."""
    waiting: int = 0
    running: int = 0
    kv_usage: float = 0.0
    """KV cache pages held by sequences / all pages (0 where the engine does not say)."""
    prefix_cache_hits: int = 0
    preemptions: int = 0
    spec_drafted: int = 0
    """Tokens drafted by speculative decoding (0 where it is off)."""
    spec_accepted: int = 0
    """Drafted tokens accepted (each one a decode step saved)."""


class Engine(Protocol):
    """A rollout engine: requests in, completions (tokens + fp32 logprobs) out."""

    name: str
    lm: LoadedModel
    """Our model of the served weights: tokenizer, config, and ``weights_sha256``, the checksum of the
    full weights served (kept current by ``update_weights``)."""
    weight_version: int

    @property
    def kernel_config(self) -> KernelConfig:
        """The operator set the engine computes with."""
        ...

    @property
    def fingerprint(self) -> str:
        """``kernel_config``'s fingerprint."""
        ...

    @property
    def failed(self) -> str:
        """Why the engine is unusable (e.g. a lost peer rank), "" while it runs."""
        ...

    @property
    def capacity_tokens(self) -> int:
        """KV cache positions the engine holds at once (what the rollout service's admission bounds)."""
        ...

    def validate(self, prompt_ids: list[int], params: SamplingParams) -> None: ...

    def add_request(self, prompt_ids: list[int], params: SamplingParams, prompt_index: int = 0) -> list: ...

    def abort(self, request_ids: Iterable) -> int: ...

    def has_unfinished(self) -> bool: ...

    def step(self) -> list[Completion]: ...

    def generate(self, prompts: Iterable[list[int]], params: SamplingParams,
                 progress: Callable[[EngineSnapshot, int, int], None] | None = None) -> list[Completion]: ...

    def stats(self) -> EngineSnapshot: ...

    def update_weights(self, state: dict[str, torch.Tensor], version: int) -> None:
        """Load a weight version (HF names, as our safetensors export writes them) and set
        ``lm.weights_sha256`` to its checksum; resets the prefix cache."""
        ...

    def reset_prefix_cache(self) -> None: ...

    def close(self) -> None:
        """End what the engine started (peer ranks, vLLM's engine core)."""
        ...


def validate_request(cfg: ModelConfig, capacity_tokens: int, prompt_ids: list[int], params: SamplingParams) -> None:
    """``ValueError`` naming what is wrong with a request (the same checks on every engine)."""
    if not prompt_ids:
        raise ValueError("prompt_ids must not be empty")
    bad = [t for t in prompt_ids if not (isinstance(t, int) and 0 <= t < cfg.vocab_size)]
    if bad:
        raise ValueError(f"prompt token id {bad[0]} is outside the vocabulary [0, {cfg.vocab_size})")
    total = len(prompt_ids) + params.max_new_tokens
    if len(prompt_ids) >= cfg.max_position_embeddings:
        raise ValueError(f"prompt of {len(prompt_ids)} tokens exceeds the model's "
                         f"{cfg.max_position_embeddings} positions")
    if total > capacity_tokens:
        raise ValueError(f"prompt + max_new_tokens = {total} tokens exceed the KV cache capacity "
                         f"({capacity_tokens} tokens)")


def generate(engine: Engine, prompts: Iterable[list[int]], params: SamplingParams,
             progress: Callable[[EngineSnapshot, int, int], None] | None = None) -> list[Completion]:
    """Run prompts to completion on ``engine``; completions come back ordered by (prompt, sample
    index); ``progress(stats, done, total)`` after every step."""
    total = sum(len(engine.add_request(list(p), params, prompt_index=i)) for i, p in enumerate(prompts))
    done: list[Completion] = []
    while engine.has_unfinished():
        done.extend(engine.step())
        if progress:
            progress(engine.stats(), len(done), total)
    return sorted(done, key=lambda c: (c.prompt_index, c.sample_index))
