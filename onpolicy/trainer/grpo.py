"""GRPO / PPO-clip as pure functions: group-relative advantages and the clipped policy loss.

Token tensors are flat: the continuation tokens of every sequence back to back (the packed layout
of the training forward), with ``lengths`` giving each sequence's token count. No padding, no mask.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor

LossAgg = Literal["token-mean", "seq-mean"]
KLEstimator = Literal["k1", "k3"]
LOSS_AGGS: tuple[str, ...] = ("token-mean", "seq-mean")
KL_ESTIMATORS: tuple[str, ...] = ("k1", "k3")


def group_advantages(rewards: Sequence[float], group_size: int, normalize_std: bool = True,
                     eps: float = 1e-6) -> list[float]:
    """GRPO advantages: each reward minus the mean of its group of ``group_size`` consecutive
    rewards (the samples of one prompt), divided by the group's standard deviation (+ ``eps``)
    when ``normalize_std``. The std is the unbiased sample std (as in verl and TRL); a group of
    one gets advantage 0. Computed in float64 with ``math.fsum``, so the result does not depend
    on the summation order."""
    if group_size < 1:
        raise ValueError(f"group_size must be >= 1, got {group_size}")
    if not eps >= 0:
        raise ValueError(f"eps must be >= 0, got {eps}")
    if len(rewards) % group_size:
        raise ValueError(f"{len(rewards)} rewards do not split into groups of {group_size}")
    if not all(math.isfinite(r) for r in rewards):
        raise ValueError("rewards must be finite")
    out: list[float] = []
    for g in range(0, len(rewards), group_size):
        group = [float(r) for r in rewards[g:g + group_size]]
        mean = math.fsum(group) / group_size
        centred = [r - mean for r in group]
        if normalize_std:
            std = math.sqrt(math.fsum(c * c for c in centred) / (group_size - 1)) if group_size > 1 else 0.0
            if std + eps > 0:  # std == 0 means every centred value is already 0
                centred = [c / (std + eps) for c in centred]
        out.extend(centred)
    return out


def kl_penalty(logprobs: Tensor, ref_logprobs: Tensor, estimator: KLEstimator) -> Tensor:
    """Per-token estimate of KL(policy ‖ reference) from tokens sampled by the policy.
    ``k1``: ``lp - ref``; ``k3``: ``exp(ref - lp) - (ref - lp) - 1`` (non-negative, low variance)."""
    if estimator == "k1":
        return logprobs - ref_logprobs
    if estimator == "k3":
        d = ref_logprobs - logprobs
        return torch.exp(d) - d - 1
    raise ValueError(f"kl_estimator must be one of {KL_ESTIMATORS}, got {estimator!r}")


@dataclass(frozen=True)
class LossStats:
    """Diagnostics of one loss evaluation (token-weighted means over the tokens of the call)."""

    tokens: int
    clip_fraction: float
    """Fraction of tokens whose clipped term was the active (larger) one."""
    approx_kl: float
    """k3 estimate of KL(old ‖ new): mean of ``exp(new - old) - (new - old) - 1``."""
    kl: float
    """Mean KL-penalty estimate against the reference policy (0 without a reference)."""


def _aggregate(per_token: Tensor, lengths: Sequence[int], loss_agg: str, normalizer: float | None) -> Tensor:
    if loss_agg == "token-mean":
        return per_token.sum() / (per_token.shape[0] if normalizer is None else normalizer)
    if loss_agg == "seq-mean":
        per_seq = torch.stack([t.mean() for t in per_token.split(list(lengths))])
        return per_seq.sum() / (len(lengths) if normalizer is None else normalizer)
    raise ValueError(f"loss_agg must be one of {LOSS_AGGS}, got {loss_agg!r}")


def policy_loss(new_lp: Tensor, old_lp: Tensor, advantages: Tensor, lengths: Sequence[int], *,
                clip_eps_low: float, clip_eps_high: float, loss_agg: str = "token-mean",
                kl_coef: float = 0.0, kl_estimator: str = "k3", ref_lp: Tensor | None = None,
                normalizer: float | None = None) -> tuple[Tensor, LossStats]:
    """PPO-clip loss with an asymmetric clip range and an optional KL penalty.

    Per token: ``r = exp(new - old)``, ``l = max(-A r, -A clip(r, 1 - eps_low, 1 + eps_high))``
    (+ ``kl_coef * kl(new, ref)`` when ``kl_coef > 0``). ``token-mean`` sums ``l`` over all tokens
    and divides by the token count; ``seq-mean`` averages within each sequence, then over sequences.
    ``normalizer`` replaces the divisor (total tokens, or total sequences) so that microbatches of
    one minibatch add up to the minibatch's loss under gradient accumulation.

    ``advantages`` is per token (``[T]``) or per sequence (``[len(lengths)]``, broadcast to tokens).
    """
    if new_lp.dim() != 1 or old_lp.shape != new_lp.shape:
        raise ValueError(f"new_lp and old_lp must be flat and of equal shape, got {tuple(new_lp.shape)} "
                         f"and {tuple(old_lp.shape)}")
    if any(n < 1 for n in lengths) or sum(lengths) != new_lp.shape[0]:
        raise ValueError(f"lengths (sum {sum(lengths)}) must be >= 1 each and cover the {new_lp.shape[0]} tokens")
    if not (0 <= clip_eps_low < 1 and clip_eps_high >= 0):
        raise ValueError(f"need 0 <= clip_eps_low < 1 and clip_eps_high >= 0, got {clip_eps_low}, {clip_eps_high}")
    if advantages.shape[0] == len(lengths) and advantages.shape[0] != new_lp.shape[0]:
        advantages = advantages.repeat_interleave(torch.tensor(list(lengths), device=advantages.device))
    if advantages.shape != new_lp.shape:
        raise ValueError(f"advantages must have one value per token or per sequence, got {tuple(advantages.shape)}")
    advantages = advantages.to(new_lp.dtype)
    log_ratio = new_lp - old_lp
    ratio = torch.exp(log_ratio)
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1 - clip_eps_low, 1 + clip_eps_high)
    per_token = torch.maximum(unclipped, clipped)
    kl_value = 0.0
    if kl_coef > 0:
        if ref_lp is None:
            raise ValueError("kl_coef > 0 needs ref_lp")
        kl = kl_penalty(new_lp, ref_lp, kl_estimator)  # type: ignore[arg-type]
        per_token = per_token + kl_coef * kl
        kl_value = float(kl.detach().mean())
    loss = _aggregate(per_token, lengths, loss_agg, normalizer)
    with torch.no_grad():
        stats = LossStats(
            tokens=int(new_lp.shape[0]),
            clip_fraction=float((clipped > unclipped).float().mean()),
            approx_kl=float((torch.exp(log_ratio) - log_ratio - 1).mean()),
            kl=kl_value,
        )
    return loss, stats
