"""A request's tokens and logprob bits do not depend on the batch it is served in (the needle), and
every completion's logprobs equal the training path's — for all families, fp32 and bf16."""

from __future__ import annotations

import random

import pytest
import torch

from onpolicy.rollout import EngineConfig, RolloutEngine, SamplingParams
from onpolicy.trainer.forward import ScoredSequence, sequence_logprobs

FAMILIES = ["tiny-llama", "tiny-qwen2", "tiny-qwen3", "tiny-qwen3-moe"]


def random_prompts(rng: random.Random, count: int, vocab: int, shared: list[int]) -> list[list[int]]:
    out = []
    for i in range(count):
        tail = [rng.randrange(vocab) for _ in range(rng.randint(1, 40))]
        out.append(shared + tail if i % 3 == 0 else tail)
    return out


def run_staggered(engine: RolloutEngine, prompts: list[list[int]], params: SamplingParams, rng: random.Random):
    order = list(range(len(prompts)))
    rng.shuffle(order)
    done = []
    while order or engine.has_unfinished():
        for _ in range(rng.randint(0, 3) if engine.has_unfinished() else 1):
            if order:
                i = order.pop()
                engine.add_request(prompts[i], params, prompt_index=i)
        if engine.has_unfinished():
            done.extend(engine.step())
    return {(c.prompt_index, c.sample_index): c for c in done}


@pytest.mark.parametrize("family", FAMILIES)
def test_needle_in_batches(load_tiny, family: str) -> None:
    lm = load_tiny(family)
    rng = random.Random(hash(family) & 0xFFFF)
    vocab = lm.config.vocab_size
    shared = [rng.randrange(vocab) for _ in range(37)]
    needle = shared + [rng.randrange(vocab) for _ in range(11)]
    params = SamplingParams(temperature=0.8, max_new_tokens=24, n=2, seed=11, ignore_eos=True)
    alone = RolloutEngine(lm, EngineConfig(max_num_seqs=1, prefix_cache=False)).generate([needle], params)
    assert len(alone) == 2 and all(len(c.token_ids) == 24 for c in alone)
    for trial, others in enumerate([0, 1, 5, 32]):
        prompts = random_prompts(rng, others, vocab, shared)
        pos = rng.randint(0, others)
        prompts.insert(pos, needle)
        cfg = EngineConfig(max_num_seqs=rng.choice([3, 8, 33]), max_batched_tokens=rng.choice([5, 17, 64, 512]),
                           page_size=16 * rng.choice([1, 2]), prefix_cache=trial % 2 == 0, kv_cache_tokens=4096)
        got = run_staggered(RolloutEngine(lm, cfg), prompts, params, rng)
        for a in alone:
            b = got[(pos, a.sample_index)]
            assert b.token_ids == a.token_ids, f"{family}: needle tokens changed with {others} others ({cfg})"
            assert torch.equal(torch.tensor(b.logprobs), torch.tensor(a.logprobs))


def check_against_trainer(lm, dtype_seed: int, max_new: int = 40):
    rng = random.Random(dtype_seed)
    vocab = lm.config.vocab_size
    prompts = random_prompts(rng, 10, vocab, [rng.randrange(vocab) for _ in range(20)])
    params = SamplingParams(temperature=1.0, max_new_tokens=max_new, n=2, seed=5, ignore_eos=True)
    engine = RolloutEngine(lm, EngineConfig(max_num_seqs=6, max_batched_tokens=29, kv_cache_tokens=2048))
    comps = engine.generate(prompts, params)
    seqs = [ScoredSequence(c.prompt_ids, c.token_ids, c.temperature) for c in comps]
    with torch.no_grad():
        trainer = sequence_logprobs(lm.model, seqs, pack_tokens=97)
    return comps, trainer


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("family", FAMILIES)
def test_rollout_logprobs_equal_trainer(load_tiny, family: str, dtype: str) -> None:
    lm = load_tiny(family, compute_dtype=dtype)
    comps, trainer = check_against_trainer(lm, 3)
    assert max(len(c.prompt_ids) + len(c.token_ids) for c in comps) > 3 * 16  # crosses KV tiles
    for c, t in zip(comps, trainer, strict=True):
        assert torch.equal(torch.tensor(c.logprobs, dtype=torch.float32), t)


@pytest.mark.parametrize("family", FAMILIES)
def test_fast_kernels_show_the_mismatch(load_tiny, family: str) -> None:
    comps, trainer = check_against_trainer(load_tiny(family, backend="fast"), 3)
    diffs = [(torch.tensor(c.logprobs) - t).abs().max().item() for c, t in zip(comps, trainer, strict=True)]
    assert max(diffs) > 0, "fast kernels unexpectedly bitwise equal: the check could not fail"


def test_greedy_and_bf16_paths_agree_with_trainer(load_tiny) -> None:
    lm = load_tiny("tiny-qwen3", compute_dtype="bf16")
    engine = RolloutEngine(lm, EngineConfig(max_num_seqs=4, max_batched_tokens=8))
    comps = engine.generate([[1, 2, 3, 4, 5] * 8, [9] * 20], SamplingParams(temperature=0, max_new_tokens=30,
                                                                            ignore_eos=True))
    seqs = [ScoredSequence(c.prompt_ids, c.token_ids, c.temperature) for c in comps]
    assert all(c.temperature == 1.0 for c in comps)  # greedy reports logprobs at temperature 1
    with torch.no_grad():
        trainer = sequence_logprobs(lm.model, seqs)
    for c, t in zip(comps, trainer, strict=True):
        assert torch.equal(torch.tensor(c.logprobs, dtype=torch.float32), t)
