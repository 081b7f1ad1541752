"""Linear with a fixed row tile: rows are padded to a multiple of ``row_tile`` so that every call,
whatever its row count, uses the same GEMM shape class (no GEMV for M=1, no M-dependent kernel)."""

from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor


def pad_rows(x: Tensor, tile: int) -> Tensor:
    """``x`` with zero rows appended along dim 0 up to a multiple of ``tile``."""
    pad = (-x.shape[0]) % tile
    if not pad:
        return x
    return F.pad(x, (0, 0) * (x.dim() - 1) + (0, pad))


def tiled_linear(x: Tensor, weight: Tensor, tile: int) -> Tensor:
    if x.dim() != 2:
        raise ValueError(f"linear expects 2-D input [N, K], got shape {tuple(x.shape)}")
    n = x.shape[0]
    return F.linear(pad_rows(x, tile), weight)[:n]
