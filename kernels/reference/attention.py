"""The attention tile routine: one numerical path for training, prefill, chunked prefill and
paged decode (DESIGN §3, alignments 1–3).

For a query at position p, keys ``0..p`` are visited in KV tiles of ``kv_tile`` positions from
position 0 ascending. Scores are fp32; positions > p are set to −inf before the tile max (so they
are exactly 0 after exp); the online-softmax state (m, l, acc) is fp32 and is advanced tile by tile
with one update formula::

    m_j = max(m_{j-1}, max(S_j))        a_j = exp(m_{j-1} - m_j)
    l_j = l_{j-1} * a_j + sum(exp(S_j - m_j))
    acc_j = acc_{j-1} * a_j + exp(S_j - m_j) @ V_j          out = acc / l

Tiles past a query's position are bitwise no-ops (a_j = exp(0) = 1, adds of exact zeros), so a
training row that visits more tiles than the decode step for the same token gets the same bits.
Query rows are grouped per (sequence, KV head) and padded to the row tile, so every GEMM has the
same shape class whatever the number of queries. Work is vectorised over tiles: the tile maxima
are combined with ``cummax`` (max is exact, so this equals the sequential recurrence) and only the
(l, acc) recurrence runs as a loop over tiles.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import Tensor

from ..kv import AttentionBatch, KVSource
from .linear import pad_rows

#: Upper bound on fp32 score elements materialised at once; query rows are processed in chunks.
_SCORE_BUDGET = 1 << 25


def group_queries(q: Tensor, batch: AttentionBatch, num_kv_heads: int, row_tile: int,
                  ) -> tuple[Tensor, Tensor, int]:
    """Packed ``q [N, Hq, D]`` -> ``[S, Hkv, R, D]`` rows (query-major, then heads of the group),
    padded to a multiple of ``row_tile``; also returns each row's position ``[S, 1, R]`` and the
    unpadded row count."""
    s, mq = batch.q_index.shape
    hq, d = q.shape[1], q.shape[2]
    g = hq // num_kv_heads
    qd = q[batch.q_index.clamp(min=0)]  # [S, Mq, Hq, D]
    qd = qd.view(s, mq, num_kv_heads, g, d).permute(0, 2, 1, 3, 4).reshape(s, num_kv_heads, mq * g, d)
    pos = batch.q_pos[:, :, None].expand(s, mq, g).reshape(s, 1, mq * g)
    rows = mq * g
    qd = pad_rows(qd.movedim(2, 0), row_tile).movedim(0, 2)
    pos = pad_rows(pos.movedim(2, 0), row_tile).movedim(0, 2)
    return qd, pos, rows


def ungroup(out: Tensor, batch: AttentionBatch, rows: int, num_rows: int) -> Tensor:
    """Inverse of :func:`group_queries`: ``[S, Hkv, R, D]`` -> packed ``[N, Hq, D]``."""
    s, hkv, _, d = out.shape
    mq = batch.q_index.shape[1]
    g = rows // mq
    o = out[:, :, :rows].reshape(s, hkv, mq, g, d).permute(0, 2, 1, 3, 4).reshape(s, mq, hkv * g, d)
    valid = batch.q_index >= 0
    result = o.new_empty((num_rows, hkv * g, d))
    result[batch.q_index[valid]] = o[valid]
    return result


def _row_sum(t: Tensor) -> Tensor:
    return t.sum(-1)


def tile_attention(q: Tensor, k: Tensor, v: Tensor, pos: Tensor, scale: float, kv_tile: int, *,
                   matmul: Callable[[Tensor, Tensor], Tensor] = torch.matmul,
                   row_sum: Callable[[Tensor], Tensor] = _row_sum) -> Tensor:
    """The tile routine. ``q [S, Hkv, R, D]``, ``k``/``v`` ``[S, Hkv, L, D]`` with ``L`` a multiple
    of ``kv_tile``, ``pos [S, 1, R]`` each row's position. Returns fp32 ``[S, Hkv, R, D]``.
    ``matmul``/``row_sum`` let a backend supply its own GEMM and row sum (the loop stays this one)."""
    s, hkv, r, d = q.shape
    length = k.shape[2]
    nb = length // kv_tile
    kt = k.float().transpose(2, 3)  # [S, Hkv, D, L]
    vb = v.float().reshape(s, hkv, nb, kv_tile, d)
    key_pos = torch.arange(length, device=q.device)
    scores = matmul(q.float(), kt) * scale  # [S, Hkv, R, L]
    scores = scores.masked_fill(key_pos > pos[..., None], float("-inf")).view(s, hkv, r, nb, kv_tile)
    m = scores.amax(-1).cummax(-1).values  # running max after each tile  [S, Hkv, R, nb]
    p = torch.exp(scores - m[..., None])
    rowsum = row_sum(p)  # [S, Hkv, R, nb]
    pv = matmul(p.transpose(2, 3), vb)  # [S, Hkv, nb, R, D]
    l_acc = rowsum[..., 0]
    acc = pv[:, :, 0]
    if nb > 1:
        alpha = torch.exp(m[..., :-1] - m[..., 1:])  # a_j for j = 1..nb-1
        for j in range(1, nb):
            a = alpha[..., j - 1]
            l_acc = l_acc * a + rowsum[..., j]
            acc = acc * a[..., None] + pv[:, :, j]
    return acc / l_acc[..., None]


def attention(q: Tensor, kv: KVSource, batch: AttentionBatch, scale: float, *, row_tile: int,
              kv_tile: int, tile: Callable[..., Tensor] = tile_attention) -> Tensor:
    length = -(-batch.max_kv_len // kv_tile) * kv_tile
    k, v = kv.dense(length)  # [S, L, Hkv, D]
    # Slots past a sequence's end are never attended (p = 0 exactly), but 0 * inf would be NaN:
    # zero their values so stale or never-written cache slots cannot leak into the output.
    beyond = torch.arange(length, device=v.device)[None, :] >= batch.kv_lens[:, None]
    v = v.masked_fill(beyond[:, :, None, None], 0)
    hkv = k.shape[2]
    if q.shape[1] % hkv:
        raise ValueError(f"{q.shape[1]} query heads are not a multiple of {hkv} KV heads")
    k, v = k.transpose(1, 2), v.transpose(1, 2)
    qd, pos, rows = group_queries(q, batch, hkv, row_tile)
    s, _, r_pad, _ = qd.shape
    chunk = max(row_tile, (_SCORE_BUDGET // max(1, s * hkv * length)) // row_tile * row_tile)
    parts = [tile(qd[:, :, r0:r0 + chunk], k, v, pos[:, :, r0:r0 + chunk], scale, kv_tile)
             for r0 in range(0, r_pad, chunk)]
    out = parts[0] if len(parts) == 1 else torch.cat(parts, dim=2)
    return ungroup(out.to(q.dtype), batch, rows, batch.num_rows)


def default_scale(head_dim: int) -> float:
    return 1.0 / math.sqrt(head_dim)
