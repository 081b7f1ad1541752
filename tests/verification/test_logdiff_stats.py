"""``LogdiffStats``: the verifier's per-step summary — tokens, bitwise mismatches, max and mean
|logdiff|, the K3 KL — over sequences and merged across batches."""

from __future__ import annotations

import math

import torch

from onpolicy.verification.logdiff import compare


def test_mean_and_max_logdiff_and_kl_over_sequences_and_merges() -> None:
    rollout = [torch.tensor([-1.0, -2.0, -0.5]), torch.tensor([-3.0])]
    trainer = [torch.tensor([-1.0, -2.5, -0.5]), torch.tensor([-2.0])]
    stats = compare(rollout, trainer)
    assert (stats.tokens_checked, stats.mismatched_tokens, stats.sequences_checked) == (4, 2, 2)
    assert stats.max_abs_logdiff == 1.0 and stats.mean_abs_logdiff == 1.5 / 4
    r = [0.0, -0.5, 0.0, 1.0]
    assert math.isclose(stats.kl_k3, sum(math.exp(x) - 1 - x for x in r) / 4, rel_tol=1e-12)
    halves = compare(rollout[:1], trainer[:1])
    halves.merge(compare(rollout[1:], trainer[1:]))
    assert halves == stats
    same = compare(rollout, rollout)
    assert same.mean_abs_logdiff == same.max_abs_logdiff == same.kl_k3 == 0.0 and same.mismatched_tokens == 0
