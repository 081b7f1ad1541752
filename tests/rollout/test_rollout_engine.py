"""Rollout engine behaviour: paging, prefix cache, preemption, stopping, seeds, weight updates."""

from __future__ import annotations

import pytest
import torch

from onpolicy.rollout import EngineConfig, RolloutEngine, SamplingParams
from onpolicy.rollout.block_manager import BlockManager
from onpolicy.rollout.sequence import Sequence

PARAMS = SamplingParams(temperature=1.0, max_new_tokens=20, seed=1, ignore_eos=True)


def seq(tokens: list[int], sid: int = 0) -> Sequence:
    return Sequence(sid, 0, 0, tuple(tokens), PARAMS, frozenset())


def test_block_manager_prefix_cache_reuses_full_pages_only() -> None:
    bm = BlockManager(num_pages=8, page_size=4, prefix_cache=True)
    a = seq(list(range(10)))
    assert bm.admit(a, 10)
    assert len(a.block_table) == 3 and bm.num_free == 5
    a.num_computed = 10
    bm.register_full_pages(a)  # pages 0..1 full (8 tokens); page 2 partial
    b = seq([*range(9), 99], 1)
    assert bm.cached_prefix(b) == a.block_table[:2]
    assert bm.admit(b, 2)
    assert b.num_computed == 8 and b.block_table[:2] == a.block_table[:2] and bm.hits == 2
    c = seq(list(range(8)), 2)  # exactly two full pages: the last token must still be computed
    assert bm.cached_prefix(c) == a.block_table[:1]
    bm.release(a)
    bm.release(b)
    assert bm.num_free == 8
    d = seq(list(range(9)), 3)  # cached pages survive release until reallocated
    assert bm.cached_prefix(d) == a.block_table[:2] or len(bm.cached_prefix(d)) == 2
    bm.reset_prefix_cache()
    assert bm.cached_prefix(d) == []


def test_admission_is_refused_without_pages_and_changes_nothing() -> None:
    bm = BlockManager(num_pages=2, page_size=4, prefix_cache=False)
    s = seq(list(range(12)))
    assert not bm.admit(s, 12)
    assert bm.num_free == 2 and s.block_table == []


def test_preemption_under_a_tiny_cache_keeps_results_bitwise(load_tiny) -> None:
    lm = load_tiny("tiny-llama")
    prompts = [[i + 1] * (5 + 3 * i) for i in range(6)]
    roomy = RolloutEngine(lm, EngineConfig(kv_cache_tokens=4096)).generate(prompts, PARAMS)
    tight = RolloutEngine(lm, EngineConfig(kv_cache_tokens=64, max_num_seqs=6, prefix_cache=False))
    got = tight.generate(prompts, PARAMS)
    assert tight.scheduler.num_preemptions > 0
    for a, b in zip(roomy, got, strict=True):
        assert a.token_ids == b.token_ids and a.logprobs == b.logprobs


def test_request_larger_than_the_cache_is_rejected(load_tiny) -> None:
    engine = RolloutEngine(load_tiny("tiny-llama"), EngineConfig(kv_cache_tokens=32))
    with pytest.raises(ValueError, match="KV cache capacity"):
        engine.add_request([1] * 20, SamplingParams(max_new_tokens=20))


@pytest.mark.parametrize("prompt", [[], [10**6], [-1]])
def test_bad_prompts_are_rejected(load_tiny, prompt: list[int]) -> None:
    engine = RolloutEngine(load_tiny("tiny-llama"))
    with pytest.raises(ValueError):
        engine.add_request(prompt, PARAMS)


@pytest.mark.parametrize("kwargs", [dict(temperature=-1.0), dict(temperature=float("nan")), dict(max_new_tokens=0),
                                    dict(n=0), dict(seed=2**64)])
def test_bad_sampling_params(kwargs: dict) -> None:
    with pytest.raises(ValueError):
        SamplingParams(**kwargs)


def test_stop_tokens_and_finish_reasons(load_tiny) -> None:
    lm = load_tiny("tiny-qwen3")
    free = RolloutEngine(lm).generate([[5, 6, 7]], SamplingParams(temperature=1.0, max_new_tokens=30, seed=4,
                                                                  ignore_eos=True))[0]
    assert free.finish_reason == "length" and len(free.token_ids) == 30
    stop_at = free.token_ids[7]
    first = free.token_ids.index(stop_at)
    stopped = RolloutEngine(lm).generate([[5, 6, 7]], SamplingParams(temperature=1.0, max_new_tokens=30, seed=4,
                                                                     ignore_eos=True, stop_token_ids=(stop_at,)))[0]
    assert stopped.finish_reason == "stop"
    assert stopped.token_ids == free.token_ids[:first + 1]
    assert stopped.logprobs == free.logprobs[:first + 1]


def test_seeds_and_sample_indices(load_tiny) -> None:
    lm = load_tiny("tiny-qwen3")
    p = [[3, 1, 4, 1, 5, 9, 2, 6]]
    a = RolloutEngine(lm).generate(p, SamplingParams(max_new_tokens=16, n=3, seed=7, ignore_eos=True))
    b = RolloutEngine(lm).generate(p, SamplingParams(max_new_tokens=16, n=3, seed=7, ignore_eos=True))
    c = RolloutEngine(lm).generate(p, SamplingParams(max_new_tokens=16, n=1, seed=8, ignore_eos=True))
    assert [x.token_ids for x in a] == [x.token_ids for x in b]
    assert len({x.token_ids for x in a}) == 3  # samples differ from each other
    assert c[0].token_ids != a[0].token_ids


def test_update_weights_changes_logprobs_and_drops_prefix_cache(load_tiny) -> None:
    from onpolicy.models.registry import load_model

    base = load_tiny("tiny-llama")
    lm = load_model("tiny-llama", base.model.ops)  # a private copy we may modify
    engine = RolloutEngine(lm)
    greedy = SamplingParams(temperature=0, max_new_tokens=8, ignore_eos=True)
    before = engine.generate([[1, 2, 3] * 12], greedy)[0]
    assert engine.blocks.cached
    state = {k: v.clone() for k, v in lm.model.state_dict().items()}
    state["model.norm.weight"] = state["model.norm.weight"] * 1.5
    engine.update_weights(state, version=3)
    assert engine.weight_version == 3 and not engine.blocks.cached
    after = engine.generate([[1, 2, 3] * 12], greedy)[0]
    assert after.weight_version == 3
    assert after.logprobs != before.logprobs
    bad = dict(state)
    bad["model.norm.weight"] = torch.zeros(3)
    with pytest.raises(ValueError, match="shape"):
        engine.update_weights(bad, version=4)
    assert engine.weight_version == 3


def test_step_clock_charges_every_phase_within_the_steps(load_tiny) -> None:
    """The engine's StepClock splits the steps' wall time into its phases: after a generation every
    phase has been charged, and together they never exceed the steps' own measured time."""
    from onpolicy.rollout.step_clock import PHASES

    eng = RolloutEngine(load_tiny("tiny-llama"), EngineConfig(max_num_seqs=4, kv_cache_tokens=512))
    eng.generate([[1, 2, 3], [4, 5]], SamplingParams(temperature=1.0, max_new_tokens=4, seed=1))
    phases = eng.clock.snapshot()
    assert tuple(phases) == PHASES
    assert all(s > 0 for s in phases.values()), phases
    assert sum(phases.values()) <= eng.counters.seconds
