"""Decoder building blocks. Every numerical step calls an operator of the ``Backend`` passed in;
no layer does arithmetic of its own beyond residual adds (exact elementwise)."""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from onpolicy.kernels import Backend
from onpolicy.kernels.reference.moe import dispatch

from .config import ModelConfig
from .context import AttentionContext


class Linear(nn.Module):
    def __init__(self, in_features: int, out_features: int, bias: bool = False) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features))
        self.bias = nn.Parameter(torch.zeros(out_features)) if bias else None

    def forward(self, x: Tensor, ops: Backend) -> Tensor:
        y = ops.linear(x, self.weight)
        return y if self.bias is None else y + self.bias


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: Tensor, ops: Backend) -> Tensor:
        return ops.rmsnorm(x, self.weight, self.eps)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int) -> None:
        super().__init__()
        self.layer = layer
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_proj = Linear(cfg.hidden_size, cfg.num_heads * cfg.head_dim, cfg.attention_bias)
        self.k_proj = Linear(cfg.hidden_size, cfg.num_kv_heads * cfg.head_dim, cfg.attention_bias)
        self.v_proj = Linear(cfg.hidden_size, cfg.num_kv_heads * cfg.head_dim, cfg.attention_bias)
        self.o_proj = Linear(cfg.num_heads * cfg.head_dim, cfg.hidden_size, cfg.attention_bias)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.scale = 1.0 / math.sqrt(cfg.head_dim)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, ctx: AttentionContext, ops: Backend) -> Tensor:
        n = x.shape[0]
        q = self.q_proj(x, ops).view(n, self.num_heads, self.head_dim)
        k = self.k_proj(x, ops).view(n, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x, ops).view(n, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q, ops), self.k_norm(k, ops)
        q, k = ops.rope(q, cos, sin), ops.rope(k, cos, sin)
        o = ops.attention(q, ctx.kv(self.layer, k, v), ctx.batch, self.scale)
        return self.o_proj(o.reshape(n, self.num_heads * self.head_dim), ops)


class MLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int) -> None:
        super().__init__()
        self.gate_proj = Linear(hidden, intermediate)
        self.up_proj = Linear(hidden, intermediate)
        self.down_proj = Linear(intermediate, hidden)

    def forward(self, x: Tensor, ops: Backend) -> Tensor:
        return self.down_proj(ops.swiglu(self.gate_proj(x, ops), self.up_proj(x, ops)), ops)


class SparseMoE(nn.Module):
    """Router (fp32 logits) -> top-k -> experts as Linear on gathered rows -> rank-ordered combine."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.top_k, self.normalize, self.num_experts = cfg.num_experts_per_tok, cfg.norm_topk_prob, cfg.num_experts
        self.gate = Linear(cfg.hidden_size, cfg.num_experts)
        self.experts = nn.ModuleList(MLP(cfg.hidden_size, cfg.moe_intermediate_size) for _ in range(cfg.num_experts))

    def forward(self, x: Tensor, ops: Backend) -> Tensor:
        router_logits = ops.linear(x.float(), self.gate.weight.float())
        routing = ops.moe_route(router_logits, self.top_k, self.normalize)
        out = x.new_zeros((x.shape[0], self.top_k, x.shape[1]))
        for e, rows, ranks in dispatch(routing, self.num_experts):
            out[rows, ranks] = self.experts[e](x[rows], ops)
        return ops.moe_combine(out, routing)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, layer)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp: nn.Module = SparseMoE(cfg) if cfg.is_moe_layer(layer) else MLP(cfg.hidden_size, cfg.intermediate_size)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, ctx: AttentionContext, ops: Backend) -> Tensor:
        x = x + self.self_attn(self.input_layernorm(x, ops), cos, sin, ctx, ops)
        return x + self.mlp(self.post_attention_layernorm(x, ops), ops)
