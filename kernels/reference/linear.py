"""Linear with a fixed row tile: rows are padded to a multiple of ``row_tile`` so that every call,
whatever its row count, uses the same GEMM shape class (no GEMV for M=1, no M-dependent kernel).

Outputs narrower than ``MIN_COLUMNS`` are computed on a weight zero-padded to that width: on x86
CPUs a GEMM with very few output columns takes another kernel path (measured: widths below 12
give other bits than the same columns of a wider GEMM), which would break column-parallel
invariance (a TP rank computing 8 of 32 columns). The selftest's column-parallel probe certifies it."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor


def pad_rows(x: Tensor, tile: int) -> Tensor:
    """``x`` with zero rows appended along dim 0 up to a multiple of ``tile``."""
    pad = (-x.shape[0]) % tile
    if not pad:
        return x
    return F.pad(x, (0, 0) * (x.dim() - 1) + (0, pad))


MIN_COLUMNS = 16


def tiled_linear(x: Tensor, weight: Tensor, tile: int) -> Tensor:
    if x.dim() != 2:
        raise ValueError(f"linear expects 2-D input [N, K], got shape {tuple(x.shape)}")
    n, out = x.shape[0], weight.shape[0]
    if out < MIN_COLUMNS:
        return F.linear(pad_rows(x, tile), pad_rows(weight, MIN_COLUMNS))[:n, :out]
    return F.linear(pad_rows(x, tile), weight)[:n]


#: Output columns per GEMM of a wide linear computed without autograd (the LM head: 49152 x 576 for
#: SmolLM2). One call over every column runs MKL's small-M GEMM at a fraction of its speed (measured,
#: 1 thread, 8 rows: 23 ms whole vs 18 ms in 1024-column calls; 32 rows: 50 vs 35 ms).
COLUMN_CHUNK = 1024


def column_chunks(out: int, chunk: int = COLUMN_CHUNK) -> list[tuple[int, int]]:
    """``[start, stop)`` column ranges of ``chunk`` columns covering ``out``; a remainder narrower
    than a quarter chunk joins the last full chunk (no narrow GEMM, see ``MIN_COLUMNS``)."""
    starts = list(range(0, out, chunk))
    if len(starts) > 1 and out - starts[-1] < chunk // 4:
        starts.pop()
    return [(a, b) for a, b in zip(starts, [*starts[1:], out], strict=True)]


def column_chunked_linear(x: Tensor, weight: Tensor, tile: int, chunk: int = COLUMN_CHUNK) -> Tensor:
    """:func:`tiled_linear` computed ``chunk`` output columns per GEMM. A column's bits do not
    depend on which other columns the call computes (column-slice invariance, the property
    column-parallel linears rely on; certified by the selftest's ``linear/column-chunks`` probe),
    so this equals ``tiled_linear``. Not for autograd (the slices' weight gradients would be
    materialised at full size each)."""
    if x.dim() != 2:
        raise ValueError(f"linear expects 2-D input [N, K], got shape {tuple(x.shape)}")
    if weight.shape[0] < 2 * chunk:
        return tiled_linear(x, weight, tile)
    n = x.shape[0]
    xp = pad_rows(x, tile)
    return torch.cat([F.linear(xp, weight[a:b]) for a, b in column_chunks(weight.shape[0], chunk)], 1)[:n]


def chunked_bmm(x: Tensor, chunks: Tensor, tile: int) -> Tensor:
    """Row-parallel chunk partials ``[C, N, Out]`` as one batched GEMM: ``x [N, C*Kc]`` is padded to
    the row tile and laid out chunk-major (contiguous, so the layout is the same whatever C is),
    ``chunks [C, Out, Kc]``. That a partial's bits do not depend on C is certified by the selftest."""
    c, _, kc = chunks.shape
    n = x.shape[0]
    xp = pad_rows(x, tile)
    xc = xp.view(xp.shape[0], c, kc).transpose(0, 1).contiguous()
    return torch.bmm(xc, chunks.transpose(1, 2))[:, :n]
