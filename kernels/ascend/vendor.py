"""Fallback provider: the reference tile routine on the NPU, with the vendor's batch-invariant
primitives (``torch.ops.batch_invariant_ops``) for every GEMM and row sum.

Used when our Ascend C operators are not built but Huawei's batch-invariant package is installed.
Training and inference still share one routine (the reference's: fixed KV tile from position 0,
−inf masking, one online-softmax formula) and the vendor GEMM / reduce-sum are batch-invariant,
so the invariance argument is the reference backend's; ``onpolicy selftest --backend ascend``
certifies it on the machine. The vendor's fused attention (FIA) is deliberately NOT used: its
training counterpart splits the reduction differently, which DESIGN §3 alignment 2 forbids.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..kv import AttentionBatch, KVSource
from ..reference.attention import _SCORE_BUDGET, group_queries, ungroup
from ..reference.linear import pad_rows


def _bi():
    return torch.ops.batch_invariant_ops


def mm(a: Tensor, b: Tensor) -> Tensor:
    """Batch-invariant ``a [M, K] @ b [K, N]``."""
    return _bi().npu_mm_batch_invariant(a, b)


def bmm(a: Tensor, b: Tensor) -> Tensor:
    """Batch-invariant batched matmul (broadcasting like ``torch.matmul``)."""
    return _bi().npu_matmul_batch_invariant(a, b)


def row_sum(x: Tensor, dim: int = -1, keepdim: bool = False) -> Tensor:
    return _bi().npu_reduce_sum_batch_invariant(x, dim, keepdim)


def linear(x: Tensor, weight: Tensor, row_tile: int) -> Tensor:
    n = x.shape[0]
    return mm(pad_rows(x, row_tile), weight.t())[:n]


def rmsnorm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    xf = x.float()
    variance = row_sum(xf * xf, -1, True) / xf.shape[-1]
    return weight * (xf * torch.rsqrt(variance + eps)).to(x.dtype)


def logprobs(hidden: Tensor, lm_head: Tensor, temperature: Tensor, row_tile: int) -> Tensor:
    logits = linear(hidden.float(), lm_head.float(), row_tile)
    z = logits / temperature[:, None]
    m = z.amax(-1, keepdim=True)
    return (z - m) - torch.log(row_sum(torch.exp(z - m), -1, True))


def tile_attention(q: Tensor, k: Tensor, v: Tensor, pos: Tensor, scale: float, kv_tile: int) -> Tensor:
    """kernels.reference.attention.tile_attention with vendor GEMMs and row sums."""
    s, hkv, r, d = q.shape
    length = k.shape[2]
    nb = length // kv_tile
    key_pos = torch.arange(length, device=q.device)
    scores = bmm(q.float(), k.float().transpose(2, 3).contiguous()) * scale
    scores = scores.masked_fill(key_pos > pos[..., None], float("-inf")).view(s, hkv, r, nb, kv_tile)
    m = scores.amax(-1).cummax(-1).values
    p = torch.exp(scores - m[..., None])
    rowsum = row_sum(p, -1, False)
    pv = bmm(p.transpose(2, 3).contiguous(), v.float().reshape(s, hkv, nb, kv_tile, d))
    l_acc, acc = rowsum[..., 0], pv[:, :, 0]
    if nb > 1:
        alpha = torch.exp(m[..., :-1] - m[..., 1:])
        for j in range(1, nb):
            a = alpha[..., j - 1]
            l_acc = l_acc * a + rowsum[..., j]
            acc = acc * a[..., None] + pv[:, :, j]
    return acc / l_acc[..., None]


def attention(q: Tensor, kv: KVSource, batch: AttentionBatch, scale: float, *, row_tile: int, kv_tile: int) -> Tensor:
    """kernels.reference.attention.attention over :func:`tile_attention`."""
    length = -(-batch.max_kv_len // kv_tile) * kv_tile
    k, v = kv.dense(length)
    hkv = k.shape[2]
    if q.shape[1] % hkv:
        raise ValueError(f"{q.shape[1]} query heads are not a multiple of {hkv} KV heads")
    k, v = k.transpose(1, 2), v.transpose(1, 2)
    qd, pos, rows = group_queries(q, batch, hkv, row_tile)
    s, _, r_pad, _ = qd.shape
    chunk = max(row_tile, (_SCORE_BUDGET // max(1, s * hkv * length)) // row_tile * row_tile)
    parts = [tile_attention(qd[:, :, r0:r0 + chunk], k, v, pos[:, :, r0:r0 + chunk], scale, kv_tile)
             for r0 in range(0, r_pad, chunk)]
    out = parts[0] if len(parts) == 1 else torch.cat(parts, dim=2)
    return ungroup(out.to(q.dtype), batch, rows, batch.num_rows)
