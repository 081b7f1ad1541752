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


def _grouped_positions(batch: AttentionBatch, g: int, row_tile: int) -> Tensor:
    s, mq = batch.q_pos.shape
    pos = batch.q_pos[:, :, None].expand(s, mq, g).reshape(s, 1, mq * g)
    return pad_rows(pos.movedim(2, 0), row_tile).movedim(0, 2)


def group_queries(q: Tensor, batch: AttentionBatch, num_kv_heads: int, row_tile: int,
                  ) -> tuple[Tensor, Tensor, int]:
    """Packed ``q [N, Hq, D]`` -> ``[S, Hkv, R, D]`` rows (query-major, then heads of the group),
    padded to a multiple of ``row_tile``; also returns each row's position ``[S, 1, R]`` and the
    unpadded row count."""
    s, mq = batch.q_index.shape
    hq, d = q.shape[1], q.shape[2]
    g = hq // num_kv_heads
    qd = q[batch.memo("q_index>=0", lambda: batch.q_index.clamp(min=0))]  # [S, Mq, Hq, D]
    qd = qd.view(s, mq, num_kv_heads, g, d).permute(0, 2, 1, 3, 4).reshape(s, num_kv_heads, mq * g, d)
    qd = pad_rows(qd.movedim(2, 0), row_tile).movedim(0, 2)
    pos = batch.memo(("grouped_pos", g, row_tile), lambda: _grouped_positions(batch, g, row_tile))
    return qd, pos, mq * g


def ungroup(out: Tensor, batch: AttentionBatch, rows: int, num_rows: int) -> Tensor:
    """Inverse of :func:`group_queries`: ``[S, Hkv, R, D]`` -> packed ``[N, Hq, D]``."""
    s, hkv, _, d = out.shape
    mq = batch.q_index.shape[1]
    g = rows // mq
    o = out[:, :, :rows].reshape(s, hkv, mq, g, d).permute(0, 2, 1, 3, 4).reshape(s, mq, hkv * g, d)
    valid = batch.memo("valid", lambda: batch.q_index >= 0)
    result = o.new_empty((num_rows, hkv * g, d))
    result[batch.memo("valid_rows", lambda: batch.q_index[valid])] = o[valid]
    return result


def _row_sum(t: Tensor) -> Tensor:
    return t.sum(-1)


def tile_attention(q: Tensor, k: Tensor, v: Tensor, pos: Tensor, scale: float, kv_tile: int, *,
                   matmul: Callable[[Tensor, Tensor], Tensor] = torch.matmul,
                   row_sum: Callable[[Tensor], Tensor] = _row_sum, mask: Tensor | None = None) -> Tensor:
    """The tile routine. ``q [S, Hkv, R, D]``, ``k``/``v`` ``[S, Hkv, L, D]`` with ``L`` a multiple
    of ``kv_tile``, ``pos [S, 1, R]`` each row's position. Returns fp32 ``[S, Hkv, R, D]``.
    ``matmul``/``row_sum`` let a backend supply its own GEMM and row sum (the loop stays this one);
    ``mask`` is ``arange(L) > pos[..., None]`` when the caller already has it."""
    s, hkv, r, d = q.shape
    length = k.shape[2]
    nb = length // kv_tile
    # contiguous head-major fp32 copies (one pass each, whatever the caller's strides); the score
    # GEMM reads K through its transposed view, the same GEMM as on a copied K^T
    kt = k.to(torch.float32, memory_format=torch.contiguous_format).transpose(2, 3)  # [S, Hkv, D, L]
    vb = v.to(torch.float32, memory_format=torch.contiguous_format).view(s, hkv, nb, kv_tile, d)
    if mask is None:
        mask = torch.arange(length, device=q.device) > pos[..., None]
    # in-place steps on fresh tensors only (no autograd input is overwritten); same ops, same bits
    scores = matmul(q.float(), kt).mul_(scale)  # [S, Hkv, R, L]
    scores = scores.masked_fill_(mask, float("-inf")).view(s, hkv, r, nb, kv_tile)
    m = scores.amax(-1).cummax(-1).values  # running max after each tile  [S, Hkv, R, nb]
    p = (scores - m[..., None]).exp_()
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


def _rows_beyond(batch: AttentionBatch, length: int) -> Tensor:
    """Flat indices ``s * length + j`` of the dense rows past each sequence's end."""
    j = torch.arange(length, device=batch.kv_lens.device)
    beyond = j[None, :] >= batch.kv_lens[:, None]
    return (torch.arange(beyond.shape[0], device=j.device)[:, None] * length + j)[beyond]


def attention(q: Tensor, kv: KVSource, batch: AttentionBatch, scale: float, *, row_tile: int,
              kv_tile: int, tile: Callable[..., Tensor] = tile_attention) -> Tensor:
    length = -(-batch.max_kv_len // kv_tile) * kv_tile
    k, v = kv.dense(length)  # fresh [S, L, Hkv, D] copies
    hkv = k.shape[2]
    if q.shape[1] % hkv:
        raise ValueError(f"{q.shape[1]} query heads are not a multiple of {hkv} KV heads")
    # Slots past a sequence's end are never attended (p = 0 exactly), but 0 * inf would be NaN:
    # zero their values so stale or never-written cache slots cannot leak into the output.
    v.view(-1, *v.shape[2:])[batch.memo(("beyond", length), lambda: _rows_beyond(batch, length))] = 0
    k, v = k.transpose(1, 2), v.transpose(1, 2)
    qd, pos, rows = group_queries(q, batch, hkv, row_tile)
    s, _, r_pad, _ = qd.shape
    chunk = max(row_tile, (_SCORE_BUDGET // max(1, s * hkv * length)) // row_tile * row_tile)
    extra: dict[str, Tensor] = {}
    if tile is tile_attention and chunk >= r_pad:  # one chunk: its causal mask serves every layer
        extra["mask"] = batch.memo(("causal", length, q.shape[1] // hkv, row_tile),
                                   lambda: torch.arange(length, device=q.device) > pos[..., None])
    parts = [tile(qd[:, :, r0:r0 + chunk], k, v, pos[:, :, r0:r0 + chunk], scale, kv_tile, **extra)
             for r0 in range(0, r_pad, chunk)]
    out = parts[0] if len(parts) == 1 else torch.cat(parts, dim=2)
    return ungroup(out.to(q.dtype), batch, rows, batch.num_rows)


def default_scale(head_dim: int) -> float:
    return 1.0 / math.sqrt(head_dim)
