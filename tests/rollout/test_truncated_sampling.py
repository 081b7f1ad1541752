"""Top-k / top-p / min-p sampling semantics: the rollout samples from the truncated, renormalised
distribution, reports its logprobs, and the trainer recomputes the same bits (``torch.equal``);
sampled tokens do not depend on the batch, never leave the kept set, and the reported logprob is
the log of the renormalised probability. Scoring the same tokens without truncation differs (a
truncated rollout is off-policy by construction unless the trainer truncates too)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from onpolicy.kernels.truncation import NONE, RowTruncation, Truncation, kept_mask, truncate
from onpolicy.rollout import EngineConfig, RolloutEngine, SamplingParams
from onpolicy.trainer.forward import ScoredSequence, sequence_logprobs

# the tiny random models are nearly flat: min-p needs a large value (and a low temperature) to cut
CASES = [Truncation(top_p=0.8), Truncation(top_k=5), Truncation(min_p=0.6),
         Truncation(top_k=40, top_p=0.9, min_p=0.3)]
PROMPTS = [[(7 * i + j) % 250 + 3 for j in range(4 + 9 * i)] for i in range(4)]


def _generate(lm, trunc: Truncation, prompts=PROMPTS, *, n: int = 2, max_num_seqs: int = 8, seed: int = 1,
              temperature: float = 1.0):
    engine = RolloutEngine(lm, EngineConfig(max_num_seqs=max_num_seqs, max_batched_tokens=37))
    params = SamplingParams(temperature=temperature, max_new_tokens=24, n=n, seed=seed, ignore_eos=True,
                            **trunc.to_dict())
    return engine.generate(prompts, params)


def _scored(comps, *, truncated: bool = True) -> list[ScoredSequence]:
    return [ScoredSequence(c.prompt_ids, c.token_ids, c.temperature,
                           **(c.truncation if truncated else NONE).to_dict()) for c in comps]


@pytest.mark.parametrize("trunc", CASES, ids=lambda t: f"k{t.top_k}-p{t.top_p:.2f}-m{t.min_p:.2f}")
@pytest.mark.parametrize("model", ["tiny-qwen3", "tiny-llama"])
def test_rollout_logprobs_equal_trainer_bitwise(load_tiny, model: str, trunc: Truncation) -> None:
    lm = load_tiny(model)
    comps = _generate(lm, trunc, temperature=0.5)
    assert all(c.truncation == trunc for c in comps)
    with torch.no_grad():
        trainer = sequence_logprobs(lm.model, _scored(comps), pack_tokens=64)
        plain = sequence_logprobs(lm.model, _scored(comps, truncated=False), pack_tokens=64)
    for c, t in zip(comps, trainer, strict=True):
        assert torch.equal(torch.tensor(c.logprobs, dtype=torch.float32), t)
    assert not torch.equal(torch.cat(trainer), torch.cat(plain))  # the truncation did cut
    # the same bits under autograd (the trainer's TokenLogprobs path)
    lm.model.requires_grad_(True)
    try:
        graded = sequence_logprobs(lm.model, _scored(comps[:2]), pack_tokens=64)
    finally:
        lm.model.requires_grad_(False)
    assert graded[0].grad_fn is not None
    for c, t in zip(comps[:2], graded, strict=True):
        assert torch.equal(torch.tensor(c.logprobs, dtype=torch.float32), t.detach())


def test_negative_control_trainer_without_truncation_differs(load_tiny) -> None:
    lm = load_tiny("tiny-qwen3")
    comps = _generate(lm, Truncation(top_p=0.7))
    with torch.no_grad():
        plain = sequence_logprobs(lm.model, _scored(comps, truncated=False), pack_tokens=64)
    rollout = torch.cat([torch.tensor(c.logprobs, dtype=torch.float32) for c in comps])
    untruncated = torch.cat(plain)
    assert not torch.equal(rollout, untruncated)
    # renormalising over a kept set of mass <= 1 only raises a token's logprob
    assert bool((rollout >= untruncated).all()) and float((rollout - untruncated).max()) > 1e-3


def test_sampled_tokens_do_not_depend_on_the_batch(load_tiny) -> None:
    lm = load_tiny("tiny-qwen3")
    trunc = Truncation(top_k=30, top_p=0.85, min_p=0.01)
    batch = _generate(lm, trunc, n=3)
    for i, prompt in enumerate(PROMPTS):
        alone = _generate(lm, trunc, [prompt], n=3, max_num_seqs=1)
        mine = [c for c in batch if c.prompt_index == i]
        for a, b in zip(alone, mine, strict=True):
            assert a.token_ids == b.token_ids
            assert torch.equal(torch.tensor(a.logprobs), torch.tensor(b.logprobs))


def test_truncation_changes_the_samples_and_greedy_ignores_it(load_tiny) -> None:
    lm = load_tiny("tiny-qwen3")
    full, cut = _generate(lm, NONE), _generate(lm, Truncation(top_k=2))
    assert [c.token_ids for c in full] != [c.token_ids for c in cut]
    greedy = _generate(lm, NONE, temperature=0.0, n=1)
    greedy_cut = _generate(lm, Truncation(top_p=0.5), temperature=0.0, n=1)
    assert [c.token_ids for c in greedy] == [c.token_ids for c in greedy_cut]
    assert [c.logprobs for c in greedy] == [c.logprobs for c in greedy_cut]
    assert all(c.truncation == NONE for c in greedy_cut)  # greedy logprobs: the full distribution at 1


def test_untruncated_rollout_keeps_todays_bits(load_tiny) -> None:
    """Off (top_k 0, top_p 1, min_p 0) is exactly the sampler without truncation."""
    lm = load_tiny("tiny-llama")
    comps = _generate(lm, Truncation(top_k=0, top_p=1.0, min_p=0.0))
    with torch.no_grad():
        plain = sequence_logprobs(lm.model, [ScoredSequence(c.prompt_ids, c.token_ids, c.temperature)
                                             for c in comps], pack_tokens=64)
    for c, t in zip(comps, plain, strict=True):
        assert torch.equal(torch.tensor(c.logprobs, dtype=torch.float32), t)


# ----------------------------------------------------------------------------- the rule itself

def _independent(lp: torch.Tensor, t: Truncation) -> torch.Tensor:
    """The kept set by the documented rule, one row at a time in float64 Python (top-k, min-p, then
    nucleus over the renormalised prefix), then log of the renormalised probability."""
    out = torch.full_like(lp, float("-inf"), dtype=torch.float64)
    for n in range(lp.shape[0]):
        row = lp[n].tolist()
        order = sorted(range(len(row)), key=lambda v: (-row[v], v))
        k = t.top_k or len(row)
        thr = torch.tensor(row[order[0]], dtype=torch.float32) + torch.log(torch.tensor(t.min_p, dtype=torch.float32))
        prefix = [v for r, v in enumerate(order) if r < k and torch.tensor(row[v], dtype=torch.float32) >= thr]
        q = [int(float(torch.tensor(row[v]).exp()) * 2**36) for v in prefix]  # fp32 exp, exact scaling
        total, run, keep = sum(q), 0, []
        for v, qv in zip(prefix, q, strict=True):
            if t.top_p >= 1 or run * 2**24 < int(t.top_p * 2**24) * total or not keep:
                keep.append(v)
            run += qv
        probs = torch.tensor([row[v] for v in keep], dtype=torch.float64).exp()
        out[n, keep] = (probs / probs.sum()).log()
    return out


ROWS = st.integers(1, 6)
TRUNC = st.builds(Truncation, top_k=st.integers(0, 40), top_p=st.floats(0.05, 1.0), min_p=st.floats(0.0, 0.5))


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), rows=ROWS, vocab=st.integers(2, 300), scale=st.floats(0.5, 6.0),
       truncs=st.lists(TRUNC, min_size=6, max_size=6), data=st.data())
def test_kept_set_logprobs_and_samples(seed: int, rows: int, vocab: int, scale: float, truncs: list[Truncation],
                                       data: st.DataObject) -> None:
    from onpolicy.kernels.sampling import sample

    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(rows, vocab, generator=gen) * scale
    if data.draw(st.booleans(), label="ties"):
        logits = logits.round()  # many exact ties: broken by vocab id
    lp = torch.log_softmax(logits, -1)
    trunc = RowTruncation.of(truncs[:rows])
    out = truncate(lp, trunc)
    keep = out > float("-inf")
    active = trunc.active
    assert torch.equal(out[~active], lp[~active])  # rows without truncation keep their bits
    for n in range(rows):
        if not bool(active[n]):
            continue
        want = _independent(lp[n:n + 1], truncs[n])[0]
        assert torch.equal(keep[n], want > float("-inf")), (truncs[n], n)
        got = out[n][keep[n]].double()
        assert float((got - want[keep[n]]).abs().max()) <= 1e-6
        assert abs(float(torch.logsumexp(out[n].double(), 0))) <= 1e-5
        assert bool(keep[n, lp[n].argmax()])  # the most likely token is always kept
    assert torch.equal(keep[active], kept_mask(lp[active], trunc.select(active.nonzero().flatten())))
    # a sampled token is always inside the kept set, alone or in the batch
    keys = torch.randint(-(2**62), 2**62, (rows,), generator=gen)
    steps = torch.randint(0, 10**6, (rows,), generator=gen)
    tokens = sample(out, keys, steps, torch.zeros(rows, dtype=torch.bool))
    assert bool(keep.gather(1, tokens[:, None]).all())
    i = data.draw(st.integers(0, rows - 1), label="row")
    alone = truncate(lp[i:i + 1], trunc.select(torch.tensor([i])))
    assert torch.equal(alone, out[i:i + 1])
    assert torch.equal(sample(alone, keys[i:i + 1], steps[i:i + 1], torch.zeros(1, dtype=torch.bool)), tokens[i:i + 1])


def test_ties_are_broken_by_vocab_id() -> None:
    lp = torch.log_softmax(torch.tensor([[1.0, 2.0, 2.0, 2.0, 0.0]]), -1)
    keep = truncate(lp, RowTruncation.of([Truncation(top_k=2)])) > float("-inf")
    assert keep.tolist() == [[False, True, True, False, False]]


def test_top_p_keeps_the_smallest_prefix_reaching_p() -> None:
    p = torch.tensor([[0.5, 0.3, 0.15, 0.05]])
    lp = p.log()
    keep = lambda tp: (truncate(lp, RowTruncation.of([Truncation(top_p=tp)])) > float("-inf")).sum().item()  # noqa: E731
    assert keep(0.49) == 1 and keep(0.51) == 2 and keep(0.79) == 2 and keep(0.81) == 3 and keep(0.999) == 4


def test_parameters_are_validated_and_rounded_to_fp32() -> None:
    for bad in (dict(top_p=0.0), dict(top_p=1.5), dict(top_k=-1), dict(min_p=-0.1), dict(min_p=2.0),
                dict(top_p=float("nan")), dict(top_k=1.5)):
        with pytest.raises(ValueError):
            Truncation(**bad)
    t = Truncation(top_p=0.9)
    assert t.top_p == float(torch.tensor(0.9, dtype=torch.float32)) and t.active
    assert not Truncation().active and Truncation.from_proto(0, 0.0, 0.0) == NONE
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(top_p=0.0)
