"""``FastBackend``: plain fused torch kernels with no invariance promise.

It is the performance baseline the consistency overhead is measured against, and a known source
of training–inference mismatch for testing the verifier and the diagnosis tool: ``F.linear`` on
unpadded rows, ``F.scaled_dot_product_attention``, torch's fused ``silu``, ``torch.topk`` routing
and logits in the compute dtype.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from .backend import Backend, MoERouting
from .kv import AttentionBatch, KVSource
from .spec.attention import group_queries, ungroup
from .spec.elementwise import rmsnorm, rope


class FastBackend(Backend):
    name = "fast"

    def linear(self, x: Tensor, weight: Tensor) -> Tensor:
        return F.linear(x, weight)

    def rmsnorm(self, x: Tensor, weight: Tensor, eps: float) -> Tensor:
        return rmsnorm(x, weight, eps)

    def rope(self, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        return rope(x, cos.to(x.dtype), sin.to(x.dtype))

    def attention(self, q: Tensor, kv: KVSource, batch: AttentionBatch, scale: float) -> Tensor:
        k, v = kv.dense(batch.max_kv_len)
        hkv = k.shape[2]
        qd, pos, rows = group_queries(q, batch, hkv, 1)
        k, v = k.transpose(1, 2), v.transpose(1, 2)  # [S, Hkv, L, D]
        mask = torch.arange(k.shape[2], device=q.device) <= pos[..., None]  # [S, 1, R, L]
        out = F.scaled_dot_product_attention(qd, k, v, attn_mask=mask, scale=scale)
        return ungroup(out, batch, rows, batch.num_rows)

    def swiglu(self, gate: Tensor, up: Tensor) -> Tensor:
        return F.silu(gate) * up

    def moe_route(self, router_logits: Tensor, top_k: int, normalize: bool) -> MoERouting:
        probs = torch.softmax(router_logits, dim=-1, dtype=torch.float32)
        weights, experts = torch.topk(probs, top_k, dim=-1)
        if normalize:
            weights = weights / weights.sum(-1, keepdim=True)
        return MoERouting(weights=weights, experts=experts)

    def moe_combine(self, expert_out: Tensor, routing: MoERouting) -> Tensor:
        return (expert_out * routing.weights[..., None].to(expert_out.dtype)).sum(1)

    def lm_logits(self, hidden: Tensor, lm_head: Tensor) -> Tensor:
        return F.linear(hidden, lm_head.to(hidden.dtype)).float()
