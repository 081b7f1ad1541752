"""Our rollout engine's throughput (generate with the KV cache; decode-only rate) and the logdiff of
its sampled logprobs against the training path, beside transformers' cached-vs-full logdiff."""

from __future__ import annotations

from collections.abc import Callable

import torch

from onpolicy.models.checkpoint import LoadedModel
from onpolicy.rollout import EngineConfig, RolloutEngine, SamplingParams
from onpolicy.trainer.forward import ScoredSequence, sequence_logprobs

from .common import median_time


def prompts_for(batch: int, prompt_len: int, vocab: int, seed: int = 0) -> list[list[int]]:
    """Random prompts (token ids from the ordinary part of the vocabulary), equally long."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(min(100, vocab // 2), min(vocab, 20000), (batch, prompt_len), generator=g).tolist()


def engine_for(lm: LoadedModel, batch: int, tokens_per_seq: int) -> RolloutEngine:
    """An engine that holds the whole batch at once (KV cache sized to it, no prefix cache)."""
    page = lm.model.ops.config.kv_tile
    kv = batch * (-(-tokens_per_seq // page) + 1) * page
    return RolloutEngine(lm, EngineConfig(max_num_seqs=batch, max_batched_tokens=max(2048, batch),
                                          kv_cache_tokens=kv, prefix_cache=False))


def generate_seconds(lm: LoadedModel, prompts: list[list[int]], new_tokens: int, repeats: int) -> float:
    """Median wall time of greedy generation of exactly ``new_tokens`` per prompt (prefill included)."""
    engine = engine_for(lm, len(prompts), len(prompts[0]) + new_tokens)
    params = SamplingParams(temperature=0, max_new_tokens=new_tokens, ignore_eos=True)
    return median_time(lambda: engine.generate(prompts, params), repeats)


def decode_tokens_per_s(seconds: Callable[[list[list[int]], int, int], float], prompts: list[list[int]],
                        new_tokens: int, repeats: int) -> float:
    """Decode-only tokens/s: the time of ``1 + new_tokens`` minus that of 1 new token (the prefill and
    the first sample), over ``new_tokens`` steps of the batch. ``seconds(prompts, n, repeats)`` times one run."""
    t1 = seconds(prompts, 1, repeats)
    tn = seconds(prompts, 1 + new_tokens, repeats)
    return len(prompts) * new_tokens / max(tn - t1, 1e-9)


def our_logdiff(lm: LoadedModel, prompts: list[list[int]], new_tokens: int) -> float:
    """max |rollout logprob - training-path logprob| over sampled (temperature 1) tokens."""
    engine = engine_for(lm, len(prompts), len(prompts[0]) + new_tokens)
    comps = engine.generate(prompts, SamplingParams(temperature=1.0, max_new_tokens=new_tokens, ignore_eos=True))
    with torch.no_grad():
        trainer = sequence_logprobs(lm.model, [ScoredSequence(c.prompt_ids, c.token_ids, c.temperature)
                                               for c in comps])
    return max(float((torch.tensor(c.logprobs) - t).abs().max()) for c, t in zip(comps, trainer, strict=True))
