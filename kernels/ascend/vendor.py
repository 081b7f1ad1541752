"""Fallback provider: the reference tile routine on the NPU, with the vendor's batch-invariant
primitives (``torch.ops.batch_invariant_ops``) for every GEMM and row sum.

Used when our Ascend C operators are not built but Huawei's batch-invariant package is installed.
Training and inference still share one routine (the reference's: fixed KV tile from position 0,
−inf masking, one online-softmax formula) and the vendor GEMM / reduce-sum are batch-invariant,
so the invariance argument is the reference backend's; ``onpolicy selftest --backend ascend``
certifies it on the machine. The vendor's fused attention (FIA) is deliberately NOT used: its
training counterpart splits the reduction differently, which the contract forbids (docs/numerics.md).
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..kv import AttentionBatch, KVSource
from ..spec.attention import attention as reference_attention
from ..spec.attention import tile_attention as reference_tile
from ..spec.linear import pad_rows


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
    """kernels.spec.attention.tile_attention's loop with vendor GEMMs and row sums."""
    return reference_tile(q, k, v, pos, scale, kv_tile, matmul=lambda a, b: bmm(a.contiguous(), b.contiguous()),
                          row_sum=lambda t: row_sum(t, -1, False))


def attention(q: Tensor, kv: KVSource, batch: AttentionBatch, scale: float, *, row_tile: int, kv_tile: int) -> Tensor:
    """kernels.spec.attention.attention over :func:`tile_attention`."""
    return reference_attention(q, kv, batch, scale, row_tile=row_tile, kv_tile=kv_tile, tile=tile_attention)
