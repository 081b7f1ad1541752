"""Logdiff = |logp_rollout − logp_trainer| per token, and its summary statistics."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass
class LogdiffStats:
    tokens_checked: int = 0
    mismatched_tokens: int = 0
    """Tokens whose two logprobs are not bitwise equal."""
    max_abs_logdiff: float = 0.0
    sequences_checked: int = 0
    kl_k3_sum: float = 0.0
    """Sum over tokens of the k3 estimator of KL(rollout || trainer): exp(r) - 1 - r, r = lp_t - lp_r."""
    abs_logdiff_sum: float = 0.0
    """Sum over tokens of |logdiff| (in fp64)."""

    def add(self, rollout: Tensor, trainer: Tensor) -> Tensor:
        """Account one sequence; returns its per-token |logdiff| (fp32)."""
        rollout, trainer = rollout.float().reshape(-1), trainer.detach().float().reshape(-1)
        if rollout.shape != trainer.shape:
            raise ValueError(f"logprob lengths differ: rollout {rollout.numel()}, trainer {trainer.numel()}")
        diff = (rollout - trainer).abs()
        self.tokens_checked += rollout.numel()
        self.mismatched_tokens += int((rollout != trainer).sum())
        if rollout.numel():
            self.max_abs_logdiff = max(self.max_abs_logdiff, float(diff.max()))
        r = (trainer - rollout).double()
        self.kl_k3_sum += float((torch.exp(r) - 1 - r).sum())
        self.abs_logdiff_sum += float(diff.double().sum())
        self.sequences_checked += 1
        return diff

    def merge(self, other: LogdiffStats) -> None:
        self.tokens_checked += other.tokens_checked
        self.mismatched_tokens += other.mismatched_tokens
        self.max_abs_logdiff = max(self.max_abs_logdiff, other.max_abs_logdiff)
        self.sequences_checked += other.sequences_checked
        self.kl_k3_sum += other.kl_k3_sum
        self.abs_logdiff_sum += other.abs_logdiff_sum

    @property
    def mean_abs_logdiff(self) -> float:
        return self.abs_logdiff_sum / self.tokens_checked if self.tokens_checked else 0.0

    @property
    def kl_k3(self) -> float:
        return self.kl_k3_sum / self.tokens_checked if self.tokens_checked else 0.0


def compare(rollout: Sequence[Tensor], trainer: Sequence[Tensor]) -> LogdiffStats:
    stats = LogdiffStats()
    for a, b in zip(rollout, trainer, strict=True):
        stats.add(a, b)
    return stats
