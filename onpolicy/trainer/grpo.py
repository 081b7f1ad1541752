"""The RL objectives as pure functions: group-relative advantages, the clipped policy loss of GRPO,
GSPO, DAPO and Dr. GRPO (token- or sequence-level ratio, three loss aggregations, an optional
rollout-correction weight and entropy bonus), DAPO's dynamic-sampling filter and overlong penalty,
and the learning-rate schedule. ``docs/algorithms.md`` writes each loss out as implemented here.

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

LossAgg = Literal["token-mean", "seq-mean", "seq-mean-token-sum-norm"]
KLEstimator = Literal["k1", "k3"]
RatioLevel = Literal["token", "sequence"]
LOSS_AGGS: tuple[str, ...] = ("token-mean", "seq-mean", "seq-mean-token-sum-norm")
KL_ESTIMATORS: tuple[str, ...] = ("k1", "k3")
RATIO_LEVELS: tuple[str, ...] = ("token", "sequence")
LR_SCHEDULES: tuple[str, ...] = ("constant", "cosine")


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
    entropy: float = 0.0
    """Mean token entropy of the current policy (0 when not given)."""


def loss_normalizer(loss_agg: str, lengths: Sequence[int], horizon: int = 0) -> float:
    """The divisor of ``loss_agg`` over sequences of ``lengths``: the token count (``token-mean``),
    the sequence count (``seq-mean``), or the sequence count times the constant ``horizon``
    (``seq-mean-token-sum-norm``, Dr. GRPO: no length normalisation)."""
    if loss_agg == "token-mean":
        return float(sum(lengths))
    if loss_agg == "seq-mean":
        return float(len(lengths))
    if loss_agg == "seq-mean-token-sum-norm":
        if horizon < 1:
            raise ValueError(f"seq-mean-token-sum-norm needs a horizon >= 1 (max_new_tokens), got {horizon}")
        return float(len(lengths) * horizon)
    raise ValueError(f"loss_agg must be one of {LOSS_AGGS}, got {loss_agg!r}")


def _aggregate(per_token: Tensor, lengths: Sequence[int], loss_agg: str, normalizer: float | None,
               horizon: int = 0) -> Tensor:
    if loss_agg == "token-mean":
        return per_token.sum() / (per_token.shape[0] if normalizer is None else normalizer)
    if loss_agg == "seq-mean":
        per_seq = torch.stack([t.mean() for t in per_token.split(list(lengths))])
        return per_seq.sum() / (len(lengths) if normalizer is None else normalizer)
    if loss_agg == "seq-mean-token-sum-norm":
        return per_token.sum() / (loss_normalizer(loss_agg, lengths, horizon) if normalizer is None else normalizer)
    raise ValueError(f"loss_agg must be one of {LOSS_AGGS}, got {loss_agg!r}")


def _log_ratio(new_lp: Tensor, old_lp: Tensor, lengths: Sequence[int], ratio_level: str) -> Tensor:
    """Per token ``new - old`` (``token``), or each sequence's mean of it broadcast to its tokens
    (``sequence``, GSPO: the log of the length-normalised sequence ratio)."""
    log_ratio = new_lp - old_lp
    if ratio_level == "token":
        return log_ratio
    if ratio_level == "sequence":
        per_seq = torch.stack([t.mean() for t in log_ratio.split(list(lengths))])
        return per_seq.repeat_interleave(torch.tensor(list(lengths), device=per_seq.device))
    raise ValueError(f"ratio_level must be one of {RATIO_LEVELS}, got {ratio_level!r}")


def policy_loss(new_lp: Tensor, old_lp: Tensor, advantages: Tensor, lengths: Sequence[int], *,
                clip_eps_low: float, clip_eps_high: float, loss_agg: str = "token-mean",
                kl_coef: float = 0.0, kl_estimator: str = "k3", ref_lp: Tensor | None = None,
                normalizer: float | None = None, ratio_level: str = "token", horizon: int = 0,
                weight: Tensor | None = None, entropy: Tensor | None = None, entropy_coef: float = 0.0,
                entropy_normalizer: float | None = None) -> tuple[Tensor, LossStats]:
    """PPO-clip loss with an asymmetric clip range, an optional KL penalty and entropy bonus.

    Per token: ``r = exp(new - old)`` (``ratio_level="sequence"``: ``r = exp(mean over the sequence
    of new - old)``, the same value on every token of a sequence), ``l = max(-A r, -A clip(r,
    1 - eps_low, 1 + eps_high))``, times ``weight`` when given (the rollout-correction weight, no
    gradient), + ``kl_coef * kl(new, ref)`` when ``kl_coef > 0``. ``token-mean`` sums ``l`` over all
    tokens and divides by the token count; ``seq-mean`` averages within each sequence, then over
    sequences; ``seq-mean-token-sum-norm`` sums over all tokens and divides by the sequence count
    times ``horizon``. ``normalizer`` replaces the divisor (so that microbatches of one minibatch add
    up to the minibatch's loss under gradient accumulation). With ``entropy_coef > 0`` the loss is
    reduced by ``entropy_coef * sum(entropy) / entropy_normalizer`` (default: this call's token
    count), the token-mean entropy of the current policy.

    ``advantages`` is per token (``[T]``) or per sequence (``[len(lengths)]``, broadcast to tokens).
    """
    if new_lp.dim() != 1 or old_lp.shape != new_lp.shape:
        raise ValueError(f"new_lp and old_lp must be flat and of equal shape, got {tuple(new_lp.shape)} "
                         f"and {tuple(old_lp.shape)}")
    if any(n < 1 for n in lengths) or sum(lengths) != new_lp.shape[0]:
        raise ValueError(f"lengths (sum {sum(lengths)}) must be >= 1 each and cover the {new_lp.shape[0]} tokens")
    if not (0 <= clip_eps_low < 1 and clip_eps_high >= 0):
        raise ValueError(f"need 0 <= clip_eps_low < 1 and clip_eps_high >= 0, got {clip_eps_low}, {clip_eps_high}")
    for name, t in (("weight", weight), ("entropy", entropy)):
        if t is not None and t.shape != new_lp.shape:
            raise ValueError(f"{name} must have one value per token, got {tuple(t.shape)}")
    if advantages.shape[0] == len(lengths) and advantages.shape[0] != new_lp.shape[0]:
        advantages = advantages.repeat_interleave(torch.tensor(list(lengths), device=advantages.device))
    if advantages.shape != new_lp.shape:
        raise ValueError(f"advantages must have one value per token or per sequence, got {tuple(advantages.shape)}")
    advantages = advantages.to(new_lp.dtype)
    ratio = torch.exp(_log_ratio(new_lp, old_lp, lengths, ratio_level))
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1 - clip_eps_low, 1 + clip_eps_high)
    per_token = torch.maximum(unclipped, clipped)
    if weight is not None:
        per_token = per_token * weight.detach().to(per_token.dtype)
    kl_value = 0.0
    if kl_coef > 0:
        if ref_lp is None:
            raise ValueError("kl_coef > 0 needs ref_lp")
        kl = kl_penalty(new_lp, ref_lp, kl_estimator)  # type: ignore[arg-type]
        per_token = per_token + kl_coef * kl
        kl_value = float(kl.detach().mean())
    loss = _aggregate(per_token, lengths, loss_agg, normalizer, horizon)
    if entropy_coef > 0:
        if entropy is None:
            raise ValueError("entropy_coef > 0 needs entropy")
        loss = loss - entropy_coef * (entropy.sum() / (entropy.shape[0] if entropy_normalizer is None
                                                       else entropy_normalizer))
    with torch.no_grad():
        log_ratio = new_lp - old_lp
        stats = LossStats(
            tokens=int(new_lp.shape[0]),
            clip_fraction=float((clipped > unclipped).float().mean()),
            approx_kl=float((torch.exp(log_ratio) - log_ratio - 1).mean()),
            kl=kl_value,
            entropy=0.0 if entropy is None else float(entropy.detach().mean()),
        )
    return loss, stats


def informative_groups(rewards: Sequence[float], group_size: int) -> list[bool]:
    """DAPO's dynamic-sampling filter: per group of ``group_size`` consecutive rewards, whether they
    are not all equal (a group whose rewards are all equal has advantage 0 everywhere and no policy
    gradient)."""
    if group_size < 1 or len(rewards) % group_size:
        raise ValueError(f"{len(rewards)} rewards do not split into groups of {group_size}")
    return [len(set(rewards[g:g + group_size])) > 1 for g in range(0, len(rewards), group_size)]


def overlong_penalty(length: int, max_new_tokens: int, buffer: int, factor: float = 1.0) -> float:
    """DAPO's soft overlong punishment, a reward term: 0 up to ``max_new_tokens - buffer`` tokens,
    then falling linearly to ``-factor`` at ``max_new_tokens``: ``min(0, -(length - (max_new_tokens
    - buffer)) / buffer * factor)``. ``buffer`` 0 turns it off."""
    if buffer <= 0:
        return 0.0
    if buffer > max_new_tokens:
        raise ValueError(f"the overlong buffer ({buffer}) exceeds max_new_tokens ({max_new_tokens})")
    exceed = length - (max_new_tokens - buffer)
    return min(0.0, -exceed / buffer * factor)


def scheduled_lr(base: float, step: int, total_steps: int, schedule: str = "constant", warmup_steps: int = 0) -> float:
    """The learning rate of step ``step`` (0-based) of ``total_steps``: linear warmup ``base * (step
    + 1) / warmup_steps`` for the first ``warmup_steps`` steps, then ``base`` (``constant``) or
    ``base * (1 + cos(pi * (step - warmup_steps) / (total_steps - warmup_steps))) / 2`` (``cosine``,
    which never reaches 0 within the run)."""
    if schedule not in LR_SCHEDULES:
        raise ValueError(f"lr_schedule must be one of {LR_SCHEDULES}, got {schedule!r}")
    if not (base > 0 and 0 <= step < total_steps and warmup_steps >= 0):
        raise ValueError(f"need base > 0, 0 <= step < total_steps, warmup_steps >= 0; got {base}, {step}, "
                         f"{total_steps}, {warmup_steps}")
    if step < warmup_steps:
        return base * (step + 1) / warmup_steps
    if schedule == "constant":
        return base
    return base * 0.5 * (1.0 + math.cos(math.pi * (step - warmup_steps) / (total_steps - warmup_steps)))
