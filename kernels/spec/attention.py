"""The attention tile routine in torch: one numerical path for training, prefill, chunked prefill
and paged decode (docs/numerics.md).

Since contract 5 the reference backend runs the same routine in C (``kernels/cpu/attention.c``,
with its own order of additions, reading K/V in place); this torch form is the specification the
Ascend backend's kernels and CPU emulation follow, and its query grouping serves the fast backend.

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

from ..kv import AttentionBatch, KVSource, PagedKV, dense_heads, head_slots, layout_key, zero_row
from .linear import pad_rows

#: Upper bound on fp32 score elements materialised at once; query rows are processed in chunks.
_SCORE_BUDGET = 1 << 25


def _grouped_positions(batch: AttentionBatch, g: int, row_tile: int) -> Tensor:
    s, mq = batch.q_pos.shape
    pos = batch.q_pos[:, :, None].expand(s, mq, g).reshape(s, 1, mq * g)
    return pad_rows(pos.movedim(2, 0), row_tile).movedim(0, 2)


def _uniform(batch: AttentionBatch) -> bool:
    """Whether the packed rows are exactly ``[S, Mq]`` in order (every sequence has Mq queries, as in a
    decode step): then grouping and ungrouping are reshapes instead of gathers and scatters."""
    return batch.memo("uniform", lambda: batch.num_rows == batch.q_index.numel() and torch.equal(
        batch.q_index.reshape(-1), torch.arange(batch.num_rows, device=batch.q_index.device)))


def group_queries(q: Tensor, batch: AttentionBatch, num_kv_heads: int, row_tile: int,
                  ) -> tuple[Tensor, Tensor, int]:
    """Packed ``q [N, Hq, D]`` -> ``[S, Hkv, R, D]`` rows (query-major, then heads of the group),
    padded to a multiple of ``row_tile``; also returns each row's position ``[S, 1, R]`` and the
    unpadded row count."""
    s, mq = batch.q_index.shape
    hq, d = q.shape[1], q.shape[2]
    g = hq // num_kv_heads
    qd = (q.reshape(s, mq, hq, d) if _uniform(batch)  # [S, Mq, Hq, D]
          else q[batch.memo("q_index>=0", lambda: batch.q_index.clamp(min=0))])
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
    if _uniform(batch) and num_rows == s * mq:
        return o.reshape(num_rows, hkv * g, d)
    valid = batch.memo("valid", lambda: batch.q_index >= 0)
    result = o.new_empty((num_rows, hkv * g, d))
    result[batch.memo("valid_rows", lambda: batch.q_index[valid])] = o[valid]
    return result


def _row_sum(t: Tensor) -> Tensor:
    return t.sum(-1)


def tile_attention(q: Tensor, k: Tensor, v: Tensor, pos: Tensor, scale: float, kv_tile: int, *,
                   matmul: Callable[[Tensor, Tensor], Tensor] = torch.matmul,
                   row_sum: Callable[[Tensor], Tensor] = _row_sum, mask: Tensor | None = None,
                   rows: int | None = None) -> Tensor:
    """The tile routine. ``q [S, Hkv, R, D]``, ``k``/``v`` ``[S, Hkv, L, D]`` with ``L`` a multiple
    of ``kv_tile``, ``pos [S, 1, R]`` each row's position. Returns fp32 ``[S, Hkv, rows, D]``: the
    first ``rows`` (default R) rows; the others are row-tile padding, whose elementwise softmax work
    is skipped (each of these steps is per element or per row, and a GEMM row does not depend on the
    other rows, so the kept rows' bits are the same).
    ``matmul``/``row_sum`` let a backend supply its own GEMM and row sum (the loop stays this one);
    ``mask`` is ``arange(L) > pos[..., None]`` when the caller already has it."""
    s, hkv, r, d = q.shape
    grad = torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad)
    keep = r if rows is None or grad else rows
    length = k.shape[2]
    nb = length // kv_tile
    # contiguous head-major fp32 copies (no copy when the caller gathered them so); the score GEMM
    # reads K through its transposed view, the same GEMM as on a copied K^T
    kt = k.to(torch.float32, memory_format=torch.contiguous_format).transpose(2, 3)  # [S, Hkv, D, L]
    vb = v.to(torch.float32, memory_format=torch.contiguous_format).view(s, hkv, nb, kv_tile, d)
    if mask is None:
        mask = torch.arange(length, device=q.device) > pos[..., None]
    # in-place steps on fresh tensors only (no autograd input is overwritten); same ops, same bits
    scores = matmul(q.float(), kt)  # [S, Hkv, R, L]
    if keep < r:
        scores, mask = scores[:, :, :keep], mask[:, :, :keep]
    scores = scores.mul_(scale).masked_fill_(mask, float("-inf")).view(s, hkv, keep, nb, kv_tile)
    m = scores.amax(-1).cummax(-1).values  # running max after each tile  [S, Hkv, keep, nb]
    if grad:
        p = (scores - m[..., None]).exp_()
        pt = p.transpose(2, 3)
    else:
        # without autograd, p is written straight into the tile-major layout [S, Hkv, nb, R, tile]
        # that the PV GEMM reads (the contiguous copy its batched matmul makes of the transposed
        # view otherwise: the same GEMM operand); padding rows stay zero
        pt = (q.new_zeros if keep < r else q.new_empty)((s, hkv, nb, r, kv_tile), dtype=torch.float32)
        p = pt.transpose(2, 3)[:, :, :keep]  # [S, Hkv, keep, nb, tile] view
        torch.sub(scores, m[..., None], out=p).exp_()
    rowsum = row_sum(p)  # [S, Hkv, keep, nb]
    pv = matmul(pt, vb)  # [S, Hkv, nb, R, D]
    if keep < r:
        pv = pv[:, :, :, :keep]
    l_acc = rowsum[..., 0]
    acc = pv[:, :, 0]
    if nb > 1:
        alpha = torch.exp(m[..., :-1] - m[..., 1:])  # a_j for j = 1..nb-1
        for j in range(1, nb):
            a = alpha[..., j - 1]
            l_acc = l_acc * a + rowsum[..., j]
            acc = acc * a[..., None] + pv[:, :, j]
    return acc / l_acc[..., None]


def _head_slots(kv: KVSource, batch: AttentionBatch, length: int, hkv: int) -> tuple[Tensor, Tensor | None]:
    """Rows of the ``[rows * Hkv, D]`` storage view for every (sequence, KV head, position) (see
    ``kv.head_slots``) and, unless positions past a sequence's end already name the source's zero
    row, the flat indices of those positions in the head-major copy (to zero their V)."""
    slots = kv.slots(length)
    beyond = torch.arange(length, device=slots.device)[None, :] >= batch.kv_lens[:, None]  # [S, L]
    zero = zero_row(kv)
    if zero is not None:
        return head_slots(slots.masked_fill(beyond, zero), hkv), None
    flat = torch.arange(beyond.numel() * hkv, device=slots.device).view(beyond.shape[0], hkv, length)
    return head_slots(slots, hkv), flat[beyond[:, None, :].expand(-1, hkv, -1)]


def attention(q: Tensor, kv: KVSource, batch: AttentionBatch, scale: float, *, row_tile: int,
              kv_tile: int, tile: Callable[..., Tensor] = tile_attention) -> Tensor:
    length = -(-batch.max_kv_len // kv_tile) * kv_tile
    hkv = kv.flat()[0].shape[1]
    if q.shape[1] % hkv:
        raise ValueError(f"{q.shape[1]} query heads are not a multiple of {hkv} KV heads")
    # one gather per step for every layer: the index tensors are functions of the batch and the
    # source's layout (the memo key keeps the source's index tensor alive, so its id stays unique)
    key = ("head_slots", length, hkv, layout_key(kv))
    _, idx, beyond = batch.memo(key, lambda: (kv.page_table if isinstance(kv, PagedKV) else kv.cu_seqlens,
                                               *_head_slots(kv, batch, length, hkv)))
    k, v = dense_heads(kv, idx)  # fresh [S, Hkv, L, D] copies
    # Slots past a sequence's end are never attended (p = 0 exactly), but 0 * inf would be NaN:
    # their values are zero (the source's zero row, or zeroed here) so stale or never-written cache
    # slots cannot leak into the output.
    if beyond is not None:
        v.view(-1, v.shape[-1])[beyond] = 0
    qd, pos, rows = group_queries(q, batch, hkv, row_tile)
    s, _, r_pad, _ = qd.shape
    chunk = max(row_tile, (_SCORE_BUDGET // max(1, s * hkv * length)) // row_tile * row_tile)
    extra: dict[str, object] = {}
    if tile is tile_attention and chunk >= r_pad:  # one chunk: its causal mask serves every layer
        extra["mask"] = batch.memo(("causal", length, q.shape[1] // hkv, row_tile),
                                   lambda: torch.arange(length, device=q.device) > pos[..., None])
    parts = []
    for r0 in range(0, r_pad, chunk):
        if tile is tile_attention:
            extra["rows"] = max(0, min(chunk, rows - r0))
        parts.append(tile(qd[:, :, r0:r0 + chunk], k, v, pos[:, :, r0:r0 + chunk], scale, kv_tile, **extra))
    out = parts[0] if len(parts) == 1 else torch.cat(parts, dim=2)
    return ungroup(out.to(q.dtype), batch, rows, batch.num_rows)


def default_scale(head_dim: int) -> float:
    return 1.0 / math.sqrt(head_dim)
