"""Counter-based Gumbel-max sampling: a request's tokens depend only on its own key, step and
logprobs — never on the batch — greedy takes the lowest id on ties, and the draws follow the
distribution."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from onpolicy.kernels.sampling import mix64, request_key, sample, uniform

INT64 = st.integers(-(2**63), 2**63 - 1)


def _logprobs(b: int, v: int, gen: torch.Generator, scale: float = 3.0) -> torch.Tensor:
    return torch.log_softmax(torch.randn(b, v, generator=gen) * scale, -1)


@settings(max_examples=25)
@given(seed=st.integers(0, 2**31 - 1), b=st.integers(1, 24), vocab=st.integers(2, 400), data=st.data())
def test_row_alone_equals_row_in_any_batch(seed: int, b: int, vocab: int, data: st.DataObject) -> None:
    gen = torch.Generator().manual_seed(seed)
    lp = _logprobs(b, vocab, gen)
    keys = torch.tensor(data.draw(st.lists(INT64, min_size=b, max_size=b), label="keys"), dtype=torch.int64)
    steps = torch.tensor(data.draw(st.lists(st.integers(0, 10**6), min_size=b, max_size=b), label="steps"))
    greedy = torch.tensor(data.draw(st.lists(st.booleans(), min_size=b, max_size=b), label="greedy"))
    together = sample(lp, keys, steps, greedy)
    assert together.shape == (b,) and together.dtype == torch.int64
    assert ((together >= 0) & (together < vocab)).all()
    i = data.draw(st.integers(0, b - 1), label="row")
    alone = sample(lp[i:i + 1], keys[i:i + 1], steps[i:i + 1], greedy[i:i + 1])
    assert torch.equal(alone, together[i:i + 1])
    # the same row at another position of a batch of other requests
    m = data.draw(st.integers(1, 24), label="other batch")
    j = data.draw(st.integers(0, m - 1), label="position")
    lp2 = _logprobs(m, vocab, gen)
    keys2 = torch.randint(-(2**62), 2**62, (m,), generator=gen)
    steps2 = torch.randint(0, 1000, (m,), generator=gen)
    greedy2 = torch.rand(m, generator=gen) < 0.5
    lp2[j], keys2[j], steps2[j], greedy2[j] = lp[i], keys[i], steps[i], greedy[i]
    assert torch.equal(sample(lp2, keys2, steps2, greedy2)[j], together[i])


def test_sampling_is_a_pure_function() -> None:
    gen = torch.Generator().manual_seed(0)
    lp = _logprobs(16, 320, gen)
    keys = torch.randint(-(2**62), 2**62, (16,), generator=gen)
    steps = torch.arange(16)
    greedy = torch.zeros(16, dtype=torch.bool)
    a = sample(lp, keys, steps, greedy)
    torch.manual_seed(123)  # the global RNG plays no part
    b = sample(lp.clone(), keys.clone(), steps.clone(), greedy)
    assert torch.equal(a, b)


def test_different_steps_and_keys_give_different_noise() -> None:
    keys = torch.tensor([5, 5, 6], dtype=torch.int64)
    steps = torch.tensor([0, 1, 0])
    u = uniform(keys, steps, 1000)
    assert not torch.equal(u[0], u[1]) and not torch.equal(u[0], u[2])
    assert (u[0] != u[1]).float().mean() > 0.99


def test_greedy_picks_lowest_id_on_ties() -> None:
    v = 50
    lp = torch.full((4, v), -10.0)
    tie_sets = [[3, 7, 40], [0, 49], [12, 13], [49, 48, 47]]
    for row, ids in enumerate(tie_sets):
        lp[row, ids] = -0.5
    keys = torch.tensor([1, 2, 3, 4], dtype=torch.int64)
    got = sample(lp, keys, torch.zeros(4, dtype=torch.int64), torch.ones(4, dtype=torch.bool))
    assert got.tolist() == [min(ids) for ids in tie_sets]


def test_greedy_ignores_the_noise() -> None:
    gen = torch.Generator().manual_seed(4)
    lp = _logprobs(32, 200, gen)
    keys = torch.randint(-(2**62), 2**62, (32,), generator=gen)
    got = sample(lp, keys, torch.randint(0, 99, (32,), generator=gen), torch.ones(32, dtype=torch.bool))
    assert torch.equal(got, lp.argmax(-1))


def test_sampled_frequencies_follow_the_distribution() -> None:
    """Over 20 000 steps of one request, each token's empirical frequency is within a loose bound
    (> 6 standard deviations would be needed to fail by chance) of its probability."""
    probs = torch.tensor([0.6, 0.25, 0.1, 0.04, 0.01])
    n = 20_000
    lp = probs.log().expand(n, -1).contiguous()
    keys = torch.full((n,), request_key(7, 0, [1, 2, 3]), dtype=torch.int64)
    got = sample(lp, keys, torch.arange(n), torch.zeros(n, dtype=torch.bool))
    freq = torch.bincount(got, minlength=5).double() / n
    for p, f in zip(probs.tolist(), freq.tolist(), strict=True):
        assert abs(f - p) <= 6 * math.sqrt(p * (1 - p) / n) + 1e-3, (p, f)


def test_impossible_tokens_never_sampled() -> None:
    lp = torch.log(torch.tensor([[0.5, 0.0, 0.5, 0.0]])).expand(2000, -1).contiguous()
    keys = torch.full((2000,), 99, dtype=torch.int64)
    got = sample(lp, keys, torch.arange(2000), torch.zeros(2000, dtype=torch.bool))
    assert set(got.tolist()) == {0, 2}


def test_uniforms_are_exact_open_interval_and_prefix_stable() -> None:
    keys = torch.tensor([0, -1, 2**63 - 1, -(2**63), 123456789], dtype=torch.int64)
    steps = torch.tensor([0, 1, 2**40, 7, 0])
    u = uniform(keys, steps, 4096)
    assert u.dtype == torch.float32 and u.shape == (5, 4096)
    assert (u > 0).all() and (u < 1).all()
    # a vocab id's uniform does not depend on the vocabulary size it is drawn with
    assert torch.equal(uniform(keys, steps, 17), u[:, :17])
    # 23-bit grid: every value is (k + 0.5) / 2**23
    k = u.double() * 2**23 - 0.5
    assert torch.equal(k, k.round())
    # roughly uniform
    assert abs(u.double().mean().item() - 0.5) < 0.01


def test_mix64_is_a_bijection_sample() -> None:
    z = torch.arange(-5000, 5000, dtype=torch.int64) * 7919
    assert torch.unique(mix64(z)).numel() == z.numel()
    assert mix64(torch.tensor([0])).item() == 0  # splitmix64 finaliser fixes 0


# ------------------------------------------------------------------------------------------ request_key


def test_request_key_is_deterministic_int64() -> None:
    k = request_key(42, 3, [1, 2, 3])
    assert k == request_key(42, 3, (1, 2, 3))
    assert -(2**63) <= k < 2**63
    torch.tensor([k], dtype=torch.int64)  # fits


@pytest.mark.parametrize(
    "other",
    [
        (43, 3, [1, 2, 3]),  # seed
        (42, 4, [1, 2, 3]),  # sample index
        (42, 3, [1, 2, 4]),  # a prompt id
        (42, 3, [3, 2, 1]),  # prompt order
        (42, 3, [1, 2]),  # prompt length
        (42, 3, [1, 2, 3, 0]),  # trailing token
        (-42, 3, [1, 2, 3]),  # sign of the seed
    ],
)
def test_request_key_depends_on_every_input(other: tuple[int, int, list[int]]) -> None:
    assert request_key(*other) != request_key(42, 3, [1, 2, 3])


def test_request_keys_do_not_collide_over_a_grid() -> None:
    keys = {request_key(s, i, [p, p + 1]) for s in range(20) for i in range(8) for p in range(20)}
    assert len(keys) == 20 * 8 * 20


def test_request_key_and_noise_pinned_values() -> None:
    """Pinned values: keys and noise are part of reproducibility across processes, machines and
    releases (a replayed rollout must sample the same tokens), so they must never change silently."""
    assert request_key(1, 0, [10, 20]) == -2527159814567652827
    assert request_key(0, 0, [0]) == 6778828807742940030
    u = uniform(torch.tensor([1]), torch.tensor([0]), 4)
    assert u.tolist() == [[0.5971190333366394, 0.15379589796066284, 0.002226889133453369, 0.9310247302055359]]
