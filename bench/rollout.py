"""Rollout measurements every suite shares: equally long random prompts, our engine sized to hold a
batch, the wall time of a greedy ``generate`` on any engine of the rollout interface, our decode-only
rate, and the max |logdiff| of an engine's sampled logprobs against our training path."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import torch

from onpolicy.models.loading import LoadedModel
from onpolicy.rollout import Completion, EngineConfig, RolloutEngine, SamplingParams
from onpolicy.trainer.forward import ScoredSequence, sequence_logprobs

from .common import median_time


def prompts_for(batch: int, prompt_len: int, vocab: int, seed: int = 0) -> list[list[int]]:
    """Random prompts (token ids from the ordinary part of the vocabulary), equally long."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(min(100, vocab // 2), min(vocab, 20000), (batch, prompt_len), generator=g).tolist()


def engine_for(lm: LoadedModel, batch: int, tokens_per_seq: int) -> RolloutEngine:
    """An engine that holds the whole batch at once and prefills it in one step (KV cache sized to
    it, no prefix cache)."""
    page = lm.model.ops.config.kv_tile
    kv = batch * (-(-tokens_per_seq // page) + 1) * page
    return RolloutEngine(lm, EngineConfig(max_num_seqs=batch, max_batched_tokens=max(2048, batch * tokens_per_seq),
                                          kv_cache_tokens=kv, prefix_cache=False))


def generate_seconds(lm: LoadedModel, prompts: list[list[int]], new_tokens: int, repeats: int) -> float:
    """Median wall time of greedy generation of exactly ``new_tokens`` per prompt (prefill included)."""
    return engine_seconds(engine_for(lm, len(prompts), len(prompts[0]) + new_tokens), prompts, new_tokens, repeats)


def engine_seconds(engine: Any, prompts: list[list[int]], new_tokens: int, repeats: int) -> float:
    """Median wall time of ``engine.generate`` (any engine of the rollout interface) producing exactly
    ``new_tokens`` per prompt, greedy, EOS ignored, prefill included; after a 2-token warm-up."""
    params = SamplingParams(temperature=0, max_new_tokens=new_tokens, ignore_eos=True)
    warm = SamplingParams(temperature=0, max_new_tokens=2, ignore_eos=True)
    return median_time(lambda: engine.generate(prompts, params), repeats, warm=lambda: engine.generate(prompts, warm))


@dataclass(frozen=True)
class DecodeRate:
    tokens_per_s: float
    step_ms: dict[str, float]
    """Milliseconds per decode step in each phase of the engine step (``onpolicy.rollout.step_clock``),
    of the run whose rate is the median."""


def decode_rate(lm: LoadedModel, prompts: list[list[int]], steps: int, repeats: int) -> DecodeRate:
    """Decode-only tokens/s: the engine's ``steps`` steps after the one that prefills every prompt
    (and samples its first token), timed on their own; median over ``repeats`` runs after a warm-up;
    with where a step's time went."""
    engine = engine_for(lm, len(prompts), len(prompts[0]) + steps + 1)
    params = SamplingParams(temperature=0, max_new_tokens=steps + 1, ignore_eos=True)

    def decode_run() -> tuple[float, dict[str, float]]:
        for p in prompts:
            engine.add_request(p, params)
        engine.step()  # the whole prefill fits one step (engine_for's token budget)
        before = engine.clock.snapshot()
        t0 = time.perf_counter()
        while engine.has_unfinished():
            engine.step()
        seconds = time.perf_counter() - t0
        after = engine.clock.snapshot()
        return seconds, {k: (after[k] - before[k]) * 1e3 / steps for k in after}

    decode_run()
    runs = sorted((decode_run() for _ in range(repeats)), key=lambda r: r[0])
    seconds, phases = runs[(len(runs) - 1) // 2]  # the median run (the lower one of an even count)
    return DecodeRate(len(prompts) * steps / seconds, phases)


def our_logdiff(lm: LoadedModel, prompts: list[list[int]], new_tokens: int) -> float:
    """max |rollout logprob - training-path logprob| of our engine over sampled (temperature 1) tokens."""
    return sampled_logdiff(engine_for(lm, len(prompts), len(prompts[0]) + new_tokens), lm, prompts, new_tokens)


def sampled_logdiff(engine: Any, trainer_lm: LoadedModel, prompts: list[list[int]], new_tokens: int) -> float:
    """max |rollout logprob - training-path logprob| over ``new_tokens`` tokens per prompt that
    ``engine`` samples at temperature 1; the training path is ``trainer_lm``'s ``sequence_logprobs``."""
    comps = engine.generate(prompts, SamplingParams(temperature=1.0, max_new_tokens=new_tokens, ignore_eos=True))
    return completions_logdiff(trainer_lm, comps)


def completions_logdiff(trainer_lm: LoadedModel, comps: list[Completion]) -> float:
    """max |logprob - training-path logprob| over every token of ``comps``."""
    with torch.no_grad():
        trainer = sequence_logprobs(trainer_lm.model, [ScoredSequence(c.prompt_ids, c.token_ids, c.temperature)
                                                       for c in comps])
    return max(float((torch.tensor(c.logprobs, dtype=torch.float32) - t).abs().max())
               for c, t in zip(comps, trainer, strict=True))
