"""Turning the backend-neutral attention inputs (AttentionBatch + ContiguousKV/PagedKV) into the
arguments of the Ascend attention operators. Pure torch, no NPU: tested on CPU.

``seq_meta`` is an int64 ``[S, 5]`` CPU tensor with one row per sequence:
``(q_offset, q_len, q_start, kv_offset, kv_len)`` — the packed row of the sequence's first query,
its number of queries, the absolute position of the first query, the packed K/V row of position 0
(contiguous K/V only) and the K/V positions it may read. The operators require each sequence's
queries to sit at consecutive positions ``q_start, q_start + 1, ...``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from ..config import KernelConfig
from ..kv import AttentionBatch, ContiguousKV, KVSource, PagedKV

META_COLUMNS = ("q_offset", "q_len", "q_start", "kv_offset", "kv_len")


def block_row_tiles(config: KernelConfig) -> int:
    """Row tiles per kernel block: blocks are whole 32-byte fp32 vectors (>= 8 rows)."""
    return max(1, 8 // config.row_tile)


@dataclass(frozen=True)
class AttentionArgs:
    """Operator-ready attention inputs."""

    q: Tensor                 # [N, Hq, D], rows grouped per sequence in position order
    seq_meta: Tensor          # [S, 5] int64, CPU
    order: Tensor | None      # packed row i of the op = row order[i] of the caller's q (None: identity)
    paged: bool


def attention_args(q: Tensor, kv: KVSource, batch: AttentionBatch, kv_tile: int) -> AttentionArgs:
    """Build ``seq_meta`` (and a row permutation if the caller's rows are not grouped per sequence)."""
    q_index = batch.q_index.detach().cpu()
    q_pos = batch.q_pos.detach().cpu()
    kv_lens = batch.kv_lens.detach().cpu().to(torch.int64)
    valid = q_index >= 0
    q_lens = valid.sum(1)
    if bool((q_lens < 1).any()):
        raise ValueError("every sequence of the batch needs at least one query")
    mq = q_index.shape[1]
    ar = torch.arange(mq)
    if not bool((valid == (ar[None, :] < q_lens[:, None])).all()):
        raise ValueError("queries of a sequence must fill q_index from the left")
    q_starts = q_pos[:, 0]
    consecutive = (q_pos == q_starts[:, None] + ar[None, :]) | ~valid
    if not bool(consecutive.all()):
        raise ValueError("the Ascend attention operators need each sequence's queries at consecutive positions")
    if bool((kv_lens < q_starts + q_lens).any()):
        raise ValueError("kv_lens must cover every query position")
    rows = q_index[valid]  # caller's rows, sequence by sequence, in position order
    offsets = torch.cumsum(q_lens, 0) - q_lens
    identity = rows.numel() == q.shape[0] and bool((rows == torch.arange(q.shape[0])).all())
    if isinstance(kv, PagedKV):
        page = kv.page_size
        if page % kv_tile:
            raise ValueError(f"page size {page} must be a multiple of kv_tile {kv_tile}")
        if bool((kv_lens > kv.page_table.shape[1] * page).any()):
            raise ValueError("page table too short for kv_lens")
        kv_offsets = torch.zeros_like(kv_lens)
        paged = True
    elif isinstance(kv, ContiguousKV):
        kv_offsets = kv.cu_seqlens.detach().cpu().to(torch.int64)[:-1]
        if kv_offsets.shape[0] != q_lens.shape[0]:
            raise ValueError("cu_seqlens must have one entry per sequence plus one")
        if bool((kv_offsets + kv_lens > kv.k.shape[0]).any()):
            raise ValueError("kv_lens reach past the packed K/V rows")
        paged = False
    else:
        raise TypeError(f"unsupported KV source {type(kv).__name__}")
    meta = torch.stack([offsets, q_lens, q_starts, kv_offsets, kv_lens], dim=1).to(torch.int64).contiguous()
    order = None if identity else rows.to(q.device)
    return AttentionArgs(q=q if order is None else q[order], seq_meta=meta, order=order, paged=paged)


def scatter_rows(out: Tensor, args: AttentionArgs, num_rows: int) -> Tensor:
    """Undo the permutation of :func:`attention_args` on the operator's output."""
    if args.order is None:
        return out
    result = out.new_zeros((num_rows, *out.shape[1:]))
    return result.index_copy(0, args.order, out)
