"""Top-k / top-p / min-p truncation of a row's logprobs, as one deterministic function of the row.

The rollout samples from, reports and the trainer recomputes the logprobs of the *truncated*
distribution: ``truncate(lp, rows)`` of the fp32 log-softmax at temperature (``Backend.logprobs``).
For a row whose truncation is active (``top_k > 0`` or ``top_p < 1`` or ``min_p > 0``):

1. **order**: tokens sorted by ``lp`` descending, ties to the lower vocab id (a stable sort), rank 0
   is the most likely token;
2. **top-k**: keep ranks ``< top_k``;
3. **min-p**: keep tokens with ``lp >= lp[rank 0] + log(min_p)`` (fp32: one ``log``, one add); with
   top-k this keeps a prefix of ranks;
4. **top-p** over that prefix renormalised: every kept probability as a fixed-point integer
   ``q = trunc(exp(lp) * 2**36)`` (int64), ``Z`` their sum, ``S(r)`` the sum of ``q`` over ranks before
   ``r``; keep rank ``r`` iff ``S(r) * 2**24 < trunc(top_p * 2**24) * Z``. Integer sums are exact, so
   the kept set does not depend on the order of summation, the batch or the device's scan;
5. rank 0 is always kept; the result is ``log_softmax`` over the kept ``lp`` (``-inf`` elsewhere).

A row with no active truncation is returned unchanged (the same bits as without truncation). Every
step is row-wise, so a row's result never depends on the other rows. Parameters are fp32 values
(``Truncation`` rounds them), so they survive the fp32 fields of the gRPC messages unchanged.
Under autograd the kept set is a constant (computed from the detached logprobs): gradients flow only
through kept tokens.
"""

from __future__ import annotations

import math
import struct
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

#: Fixed-point scale of a probability in the top-p cumulative sum.
PROB_BITS = 36
#: Fixed-point scale of ``top_p``.
TOP_P_BITS = 24
#: Rows truncated per pass (bounds the int64 temporaries of a large trainer pack).
_CHUNK_ELEMENTS = 1 << 22


def fp32(x: float) -> float:
    """``x`` rounded to the nearest fp32 value (as a Python float)."""
    return struct.unpack("<f", struct.pack("<f", float(x)))[0]


@dataclass(frozen=True)
class Truncation:
    """One row's truncation: ``top_k`` (0 = off), ``top_p`` (1 = off), ``min_p`` (0 = off). Values
    are validated and rounded to fp32 on construction."""

    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0

    def __post_init__(self) -> None:
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or not 0 <= self.top_k < 2**31:
            raise ValueError(f"top_k must be an integer >= 0 (0 = off), got {self.top_k!r}")
        for name, lo_open in (("top_p", True), ("min_p", False)):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v):
                raise ValueError(f"{name} must be a finite number, got {v!r}")
            if not ((0 < v <= 1) if lo_open else (0 <= v <= 1)):
                raise ValueError(f"{name} must be in {'(0, 1]' if lo_open else '[0, 1]'}, got {v}")
            object.__setattr__(self, name, fp32(v))
        if self.top_p == 0:  # a positive value below fp32's smallest
            raise ValueError("top_p must be > 0")

    @property
    def active(self) -> bool:
        return self.top_k > 0 or self.top_p < 1 or self.min_p > 0

    def to_dict(self) -> dict[str, float | int]:
        return {"top_k": self.top_k, "top_p": self.top_p, "min_p": self.min_p}

    @classmethod
    def from_proto(cls, top_k: int, top_p: float, min_p: float) -> Truncation:
        """From proto3 scalars, where 0 means unset: ``top_p`` 0 is 1 (off)."""
        return cls(top_k=int(top_k), top_p=float(top_p) or 1.0, min_p=float(min_p))


NONE = Truncation()
"""No truncation."""


@dataclass(frozen=True)
class RowTruncation:
    """Per-row truncation of ``N`` rows: ``top_k`` int64 ``[N]``, ``top_p`` / ``min_p`` fp32 ``[N]``."""

    top_k: Tensor
    top_p: Tensor
    min_p: Tensor

    @classmethod
    def of(cls, rows: Sequence[Truncation], device: torch.device | str = "cpu") -> RowTruncation:
        return cls(torch.tensor([r.top_k for r in rows], dtype=torch.int64, device=device),
                   torch.tensor([r.top_p for r in rows], dtype=torch.float32, device=device),
                   torch.tensor([r.min_p for r in rows], dtype=torch.float32, device=device))

    @property
    def active(self) -> Tensor:
        """``[N]`` bool: rows whose truncation is on."""
        return (self.top_k > 0) | (self.top_p < 1) | (self.min_p > 0)

    def select(self, rows: Tensor) -> RowTruncation:
        return RowTruncation(self.top_k[rows], self.top_p[rows], self.min_p[rows])


def kept_mask(logprobs: Tensor, trunc: RowTruncation) -> Tensor:
    """``[N, V]`` bool: the tokens each row keeps (every row is truncated; see the module docstring)."""
    lp = logprobs.detach()
    n, vocab = lp.shape
    vals, order = torch.sort(lp, dim=-1, descending=True, stable=True)
    ranks = torch.arange(vocab, device=lp.device)
    k = torch.where(trunc.top_k > 0, trunc.top_k, vocab)
    thresh = vals[:, :1] + torch.log(trunc.min_p.to(lp.device))[:, None]
    prefix = (ranks[None, :] < k[:, None]) & (vals >= thresh)
    q = vals.exp().mul_(2.0 ** PROB_BITS).to(torch.int64).masked_fill_(~prefix, 0)
    cum = q.cumsum(dim=-1)
    total = cum[:, -1:]
    p_units = trunc.top_p.mul(2.0 ** TOP_P_BITS).to(torch.int64)[:, None]
    nucleus = (p_units >= 1 << TOP_P_BITS) | ((cum - q) * (1 << TOP_P_BITS) < p_units * total)
    keep_sorted = prefix & nucleus
    keep_sorted[:, 0] = True
    return torch.zeros(n, vocab, dtype=torch.bool, device=lp.device).scatter_(1, order, keep_sorted)


def _truncate_all(logprobs: Tensor, trunc: RowTruncation) -> Tensor:
    keep = kept_mask(logprobs, trunc)
    return torch.log_softmax(logprobs.masked_fill(~keep, float("-inf")), dim=-1)


def truncate(logprobs: Tensor, trunc: RowTruncation | None) -> Tensor:
    """The truncated, renormalised logprobs of ``logprobs [N, V]`` (fp32). Rows without active
    truncation keep their bits; with none anywhere ``logprobs`` itself is returned."""
    if trunc is None or logprobs.shape[0] == 0:
        return logprobs
    active = trunc.active.to(logprobs.device)
    if not bool(active.any()):
        return logprobs
    rows = active.nonzero().flatten()
    out = logprobs.clone()
    step = max(1, _CHUNK_ELEMENTS // max(1, logprobs.shape[1]))
    for start in range(0, rows.numel(), step):
        r = rows[start:start + step]
        out[r] = _truncate_all(logprobs[r], trunc.select(r.to(trunc.top_k.device)))
    return out
