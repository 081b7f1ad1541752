"""Rollout correction for engines whose logprobs are not the trainer's bits: the importance weight
rollout -> trainer, truncated (TIS) or masked (MIS), per token or per sequence, and its statistics
(the ratio histogram and the fraction truncated or masked).

The weight of a token is ``w = exp(old - rollout)``: ``old`` the trainer's recomputed logprob of the
weights that sampled it, ``rollout`` the logprob the rollout reported. At ``level="sequence"`` every
token of a sequence carries the sequence's weight ``exp(sum over its tokens of old - rollout)``. The
log-weight is clamped to ``[-20, 20]`` (as verl does) so a long sequence cannot overflow. ``tis``
uses ``min(w, threshold)``; ``mis`` uses ``w`` where ``w <= threshold`` and 0 elsewhere. When the
rollout's logprobs are the trainer's bits (logdiff 0), ``old - rollout`` is exactly 0, every weight is
exactly 1 and multiplying the loss by it changes no bit.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

CORRECTION_MODES: tuple[str, ...] = ("none", "tis", "mis")
CORRECTION_LEVELS: tuple[str, ...] = ("token", "sequence")
RATIO_BUCKETS: tuple[float, ...] = (0.5, 0.8, 0.9, 0.95, 0.99, 0.999, 1.0, 1.001, 1.01, 1.05, 1.1, 1.25, 2.0, 5.0)
"""Upper bounds (``le``) of the weight histogram's buckets; a last bucket holds the rest (``+Inf``)."""
LOG_WEIGHT_BOUND = 20.0


@dataclass(frozen=True)
class CorrectionStats:
    """The weights of one step: a histogram (one value per token, or per sequence at sequence
    level) and the tokens whose weight was truncated (TIS) or masked (MIS)."""

    tokens: int = 0
    corrected_tokens: int = 0
    bucket_counts: tuple[int, ...] = (0,) * (len(RATIO_BUCKETS) + 1)
    """Values per bucket (not cumulative), ``len(RATIO_BUCKETS) + 1`` of them."""
    ratio_sum: float = 0.0

    @property
    def count(self) -> int:
        return sum(self.bucket_counts)

    @property
    def fraction(self) -> float:
        """Fraction of tokens whose weight was truncated or masked (0 without tokens)."""
        return self.corrected_tokens / self.tokens if self.tokens else 0.0

    def __add__(self, other: CorrectionStats) -> CorrectionStats:
        return CorrectionStats(self.tokens + other.tokens, self.corrected_tokens + other.corrected_tokens,
                               tuple(a + b for a, b in zip(self.bucket_counts, other.bucket_counts, strict=True)),
                               self.ratio_sum + other.ratio_sum)


def raw_weights(trainer_lp: Tensor, rollout_lp: Tensor, level: str) -> Tensor:
    """The uncorrected weights of one sequence's tokens (``[T]``): per token, or the sequence's."""
    log_w = trainer_lp - rollout_lp
    if level == "sequence":
        log_w = log_w.sum().expand(log_w.shape[0])
    elif level != "token":
        raise ValueError(f"correction level must be one of {CORRECTION_LEVELS}, got {level!r}")
    return torch.exp(log_w.clamp(-LOG_WEIGHT_BOUND, LOG_WEIGHT_BOUND))


def apply_correction(w: Tensor, mode: str, threshold: float) -> tuple[Tensor, Tensor]:
    """``(weights the loss is multiplied by, which tokens were truncated or masked)``."""
    over = w > threshold
    if mode == "tis":
        return torch.clamp(w, max=threshold), over
    if mode == "mis":
        return torch.where(over, torch.zeros_like(w), w), over
    raise ValueError(f"correction mode must be tis or mis, got {mode!r}")


def histogram(values: Tensor) -> tuple[int, ...]:
    """Counts of ``values`` per ``RATIO_BUCKETS`` bucket (``v <= le``), the last one ``+Inf``."""
    bounds = torch.tensor(RATIO_BUCKETS, dtype=values.dtype, device=values.device)
    index = torch.bucketize(values, bounds)  # boundaries[i-1] < v <= boundaries[i]
    return tuple(int(c) for c in torch.bincount(index, minlength=len(RATIO_BUCKETS) + 1))


def correction_weights(trainer: Sequence[Tensor], rollout: Sequence[Tensor], mode: str, level: str,
                       threshold: float) -> tuple[list[Tensor], CorrectionStats]:
    """Per sequence, the correction weight of each token, and the statistics over all of them."""
    out: list[Tensor] = []
    stats = CorrectionStats()
    for new, old in zip(trainer, rollout, strict=True):
        w = raw_weights(new, old, level)
        weight, over = apply_correction(w, mode, threshold)
        measured = w[:1] if level == "sequence" else w
        stats = stats + CorrectionStats(int(w.shape[0]), int(over.sum()), histogram(measured),
                                        float(measured.sum()))
        out.append(weight)
    return out, stats
