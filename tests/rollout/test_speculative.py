"""Invariant speculative decoding: with n-gram drafts the engine emits the same tokens and the same
logprob bits as plain decoding (``torch.equal``), greedy and sampled with top-p, fp32 and bf16, alone
and in batches, and the trainer recomputes those bits; drafts are really accepted on repetitive
prompts; on the fast (non-invariant) kernels the same comparison fails."""

from __future__ import annotations

import copy
import random

import pytest
import torch

from onpolicy.models.loading import LoadedModel
from onpolicy.rollout import Completion, EngineConfig, RolloutEngine, SamplingParams
from onpolicy.rollout.speculative import SpeculativeConfig, accept, propose_ngram
from onpolicy.trainer.forward import ScoredSequence, sequence_logprobs

NGRAM = SpeculativeConfig(method="ngram", num_tokens=4, ngram_min=1, ngram_max=3)
GREEDY = SamplingParams(temperature=0, max_new_tokens=40, ignore_eos=True)
TOP_P = SamplingParams(temperature=1.0, top_p=0.9, max_new_tokens=40, n=2, seed=3, ignore_eos=True)


_SHARP: dict[tuple[str, str, str], LoadedModel] = {}


def sharp(load_tiny, family: str, backend: str = "reference", dtype: str = "fp32") -> LoadedModel:
    """``lm`` with its final norm scaled by 8: the random tiny models are nearly flat (a sampled draft
    would almost never be accepted); this one samples at ~1 nat per token at temperature 1."""
    key = (family, backend, dtype)
    if key not in _SHARP:
        lm = load_tiny(family, compute_dtype=dtype, backend=backend)
        model = copy.deepcopy(lm.model)
        with torch.no_grad():
            model.model.norm.weight.mul_(8)
        _SHARP[key] = LoadedModel(f"{lm.name}-sharp", model, lm.tokenizer, lm.weights_sha256)
    return _SHARP[key]


def prompts_for(vocab: int, batch: int, seed: int = 0) -> list[list[int]]:
    """Repetitive prompts (drafts get accepted) alternating with random ones, of different lengths."""
    rng = random.Random(seed)
    out = []
    for i in range(batch):
        if i % 2 == 0:
            unit = [rng.randrange(vocab) for _ in range(3 + i)]
            out.append(unit * (4 + i % 3))
        else:
            out.append([rng.randrange(vocab) for _ in range(5 + 7 * i)])
    return out


def run(lm, prompts, params: SamplingParams, spec: SpeculativeConfig | None = None,
        **cfg) -> tuple[list[Completion], RolloutEngine]:
    engine = RolloutEngine(lm, EngineConfig(kv_cache_tokens=4096, **cfg, **({"speculative": spec} if spec else {})))
    return engine.generate(prompts, params), engine


def same_bits(a: list[Completion], b: list[Completion]) -> bool:
    return len(a) == len(b) and all(
        x.token_ids == y.token_ids and torch.equal(torch.tensor(x.logprobs), torch.tensor(y.logprobs))
        for x, y in zip(a, b, strict=True))


def test_ngram_proposer_takes_the_longest_most_recent_match() -> None:
    tokens = [1, 2, 3, 9, 1, 2, 3, 4, 5, 7, 2, 3]
    assert propose_ngram(tokens, 3, 1, 3) == [4, 5, 7]  # "2 3" last seen at 5..6, followed by 4 5 7
    assert propose_ngram(tokens, 1, 1, 3) == [4]
    assert propose_ngram([1, 2, 3, 4], 4, 1, 3) == []  # no earlier occurrence
    assert propose_ngram([1, 2, 3, 4, 8, 4], 4, 2, 3) == []  # only a 1-gram matches
    assert propose_ngram([1, 2, 3, 4, 8, 4], 4, 1, 3) == [8, 4, 8, 4]  # "4" at 3, then the copy goes on
    assert propose_ngram([7, 7, 7], 3, 1, 2) == [7, 7, 7]  # "7 7" at 0..1: one follower, then the draft
    assert propose_ngram([5, 1, 2, 1, 2], 5, 2, 2) == [1, 2, 1, 2, 1]  # period 2
    assert propose_ngram([9, 3, 4, 9, 3], 2, 2, 2) == [4, 9]
    assert propose_ngram(tokens, 0, 1, 3) == []
    assert accept([4, 5, 6], [4, 5, 9, 1]) == 2 and accept([4], [3, 1]) == 0 and accept([], [3]) == 0


@pytest.mark.parametrize("kwargs", [dict(method="eagle"), dict(num_tokens=0), dict(num_tokens=65),
                                    dict(ngram_min=0), dict(ngram_min=3, ngram_max=2)])
def test_bad_speculative_config(kwargs: dict) -> None:
    with pytest.raises(ValueError):
        SpeculativeConfig(**{"method": "ngram", **kwargs})


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("params", [GREEDY, TOP_P], ids=["greedy", "t1-top-p"])
@pytest.mark.parametrize("batch", [1, 5])
def test_speculative_equals_plain_bitwise(load_tiny, dtype: str, params: SamplingParams, batch: int) -> None:
    lm = sharp(load_tiny, "tiny-qwen3", dtype=dtype)
    prompts = prompts_for(lm.config.vocab_size, batch)
    plain, _ = run(lm, prompts, params)
    spec, engine = run(lm, prompts, params, NGRAM)
    stats = engine.stats()
    assert stats.spec_accepted > 0 and stats.spec_drafted >= stats.spec_accepted
    if batch == 1:
        assert stats.steps < len(plain[0].token_ids) * params.n  # fewer steps than one per token
    assert same_bits(plain, spec)
    assert stats.tokens_generated == sum(len(c.token_ids) for c in spec)


def test_random_prompts_and_mixed_requests_under_a_tight_schedule(load_tiny) -> None:
    """Random prompts (drafts mostly rejected), a greedy and a sampled request in one batch, a small
    token budget, a small KV cache (preemption) and stop tokens: still bitwise plain decoding."""
    lm = sharp(load_tiny, "tiny-llama")
    rng = random.Random(4)
    vocab = lm.config.vocab_size
    prompts = [[rng.randrange(vocab) for _ in range(rng.randint(3, 30))] for _ in range(6)]
    prompts += prompts_for(vocab, 4, seed=9)
    reqs = [(p, GREEDY if i % 2 else SamplingParams(temperature=0.7, top_k=20, top_p=0.9, max_new_tokens=30,
                                                    seed=i, ignore_eos=True)) for i, p in enumerate(prompts)]
    first, _ = run(lm, [prompts[-2]], GREEDY)
    stop = first[0].token_ids[len(first[0].token_ids) // 2]  # a token met mid-completion
    stopped = SamplingParams(temperature=0, max_new_tokens=40, stop_token_ids=(stop,), ignore_eos=True)
    reqs.append((prompts[-2], stopped))

    def serve(spec: SpeculativeConfig | None) -> tuple[dict, RolloutEngine]:
        engine = RolloutEngine(lm, EngineConfig(kv_cache_tokens=160, max_num_seqs=5, max_batched_tokens=7,
                                                prefix_cache=True, **({"speculative": spec} if spec else {})))
        done = {}
        for i, (p, params) in enumerate(reqs):
            engine.add_request(p, params, prompt_index=i)
            done.update({c.prompt_index: c for c in engine.step()})
        while engine.has_unfinished():
            done.update({c.prompt_index: c for c in engine.step()})
        return done, engine

    plain, _ = serve(None)
    spec, engine = serve(NGRAM)
    assert engine.stats().spec_accepted > 0 and engine.scheduler.num_preemptions > 0
    assert plain[len(reqs) - 1].finish_reason == "stop" and len(plain[len(reqs) - 1].token_ids) < 40
    keys = sorted(plain)
    assert keys == sorted(spec) == list(range(len(reqs)))
    assert same_bits([plain[k] for k in keys], [spec[k] for k in keys])
    assert engine.blocks.num_free == engine.blocks.num_pages  # every page (rolled-back ones too) came back


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_speculative_logprobs_equal_the_trainers(load_tiny, dtype: str) -> None:
    lm = sharp(load_tiny, "tiny-qwen3", dtype=dtype)
    comps, engine = run(lm, prompts_for(lm.config.vocab_size, 4), TOP_P, NGRAM)
    assert engine.stats().spec_accepted > 0
    seqs = [ScoredSequence(c.prompt_ids, c.token_ids, c.temperature, **c.truncation.to_dict()) for c in comps]
    with torch.no_grad():
        trainer = sequence_logprobs(lm.model, seqs, pack_tokens=61)
    for c, t in zip(comps, trainer, strict=True):
        assert torch.equal(torch.tensor(c.logprobs, dtype=torch.float32), t)


def test_negative_control_fast_kernels_change_the_bits(load_tiny) -> None:
    """On the fast kernels a multi-row verify forward is not bitwise a decode step: the same check fails."""
    lm = sharp(load_tiny, "tiny-qwen3", "fast")
    prompts = prompts_for(lm.config.vocab_size, 3)
    plain, _ = run(lm, prompts, GREEDY)
    spec, engine = run(lm, prompts, GREEDY, NGRAM)
    assert engine.stats().spec_accepted > 0
    assert not same_bits(plain, spec)



def test_stop_tokens_met_inside_accepted_drafts(load_tiny) -> None:
    """A repetitive greedy completion, stopped at each of its first tokens in turn: most tokens come
    from accepted drafts, so stops land inside them; the output ends at the stop token as plain
    decoding's does, with the same bits."""
    lm = sharp(load_tiny, "tiny-qwen3")
    prompt = prompts_for(lm.config.vocab_size, 1)[0]
    full, engine = run(lm, [prompt], GREEDY, NGRAM)
    assert engine.stats().spec_accepted * 2 >= len(full[0].token_ids)
    for stop in dict.fromkeys(full[0].token_ids[1:12]):
        params = SamplingParams(temperature=0, max_new_tokens=40, stop_token_ids=(stop,), ignore_eos=True)
        plain, _ = run(lm, [prompt], params)
        spec, _ = run(lm, [prompt], params, NGRAM)
        assert plain[0].finish_reason == spec[0].finish_reason == "stop" and plain[0].token_ids[-1] == stop
        assert same_bits(plain, spec)
