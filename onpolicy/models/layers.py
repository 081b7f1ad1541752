"""Decoder building blocks. Every numerical step calls an operator of the ``Backend`` passed in;
no layer does arithmetic of its own beyond residual adds (exact elementwise).

The model is described unsharded; tensor and expert parallelism are applied from outside by
``onpolicy.parallel.parallelize``, which swaps these modules for sharded subclasses. ``o_proj`` and
``down_proj`` reduce in the canonical chunk order (``RowLinear``) already here, so a sharded model
gives the bits of this one.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import Tensor, nn

from onpolicy.kernels import Backend
from onpolicy.kernels.backend import SINGLE, DenseLayer, DenseStack, MoERouting, ShardGroup, chunk_major
from onpolicy.kernels.spec.moe import dispatch

from .config import ModelConfig
from .context import AttentionContext


class Linear(nn.Module):
    def __init__(self, in_features: int, out_features: int, bias: bool = False) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features))
        self.bias = nn.Parameter(torch.zeros(out_features)) if bias else None

    def forward(self, x: Tensor, ops: Backend) -> Tensor:
        return self.add_bias(ops.linear(x, self.weight))

    def add_bias(self, y: Tensor) -> Tensor:
        return y if self.bias is None else y + self.bias


def project(x: Tensor, ops: Backend, *projections: Linear) -> list[Tensor]:
    """``[p(x, ops) for p in projections]`` — as one ``Backend.linears`` call when the backend groups
    projections (the same bits; a capturing backend keeps one call per module)."""
    if not ops.groups_projections:
        return [p(x, ops) for p in projections]
    ys = ops.linears(x, [p.weight for p in projections])
    return [p.add_bias(y) for p, y in zip(projections, ys, strict=True)]


class RowLinear(Linear):
    """A linear reduced over its input dim in the canonical chunk order (``Backend.row_linear``), the
    same at every tensor-parallel degree: unsharded (``group`` ``SINGLE``) ``weight [Out, K]``; row-
    parallel (``onpolicy.parallel.parallelize``) this rank's slice ``[Out, K / degree]`` of the input
    dim, the output reduced over ``group`` and replicated."""

    def __init__(self, in_features: int, out_features: int, group: ShardGroup = SINGLE, bias: bool = False) -> None:
        super().__init__(in_features // group.degree, out_features, bias)
        self.group = group
        self._chunk_cache: tuple[tuple[int, int, int], Tensor] | None = None

    def chunked(self, chunks: int) -> Tensor:
        """``[chunks, Out, K_local / chunks]`` contiguous. Without autograd the copy is cached until
        the weight changes (the copy is exact either way)."""
        w = self.weight
        if torch.is_grad_enabled() and w.requires_grad:
            return chunk_major(w, chunks)
        key = (w.data_ptr(), w._version, chunks)
        if self._chunk_cache is None or self._chunk_cache[0] != key:
            self._chunk_cache = (key, chunk_major(w.detach(), chunks))
        return self._chunk_cache[1]

    def forward(self, x: Tensor, ops: Backend) -> Tensor:
        return self.add_bias(ops.row_linear(x, self, self.group))


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
        self.q_proj = Linear(cfg.hidden_size, cfg.num_heads * cfg.head_dim, cfg.qkv_bias)
        self.k_proj = Linear(cfg.hidden_size, cfg.num_kv_heads * cfg.head_dim, cfg.qkv_bias)
        self.v_proj = Linear(cfg.hidden_size, cfg.num_kv_heads * cfg.head_dim, cfg.qkv_bias)
        self.o_proj = RowLinear(cfg.num_heads * cfg.head_dim, cfg.hidden_size, bias=cfg.o_bias)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.scale = 1.0 / math.sqrt(cfg.head_dim)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, ctx: AttentionContext, ops: Backend) -> Tensor:
        q, k, v = self.project_qkv(x, ops)
        return self.attend(q, k, v, cos, sin, ctx, ops)

    def project_qkv(self, x: Tensor, ops: Backend) -> tuple[Tensor, Tensor, Tensor]:
        return tuple(project(x, ops, self.q_proj, self.k_proj, self.v_proj))  # type: ignore[return-value]

    def attend(self, q: Tensor, k: Tensor, v: Tensor, cos: Tensor, sin: Tensor, ctx: AttentionContext,
               ops: Backend) -> Tensor:
        """Heads, q/k norms, RoPE, attention over ``ctx``'s K/V and the output projection."""
        n = q.shape[0]
        q = q.view(n, self.num_heads, self.head_dim)
        k, v = k.view(n, self.num_kv_heads, self.head_dim), v.view(n, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q, ops), self.k_norm(k, ops)
        q, k = ops.rope(q, cos, sin), ops.rope(k, cos, sin)
        o = ops.attention(q, ctx.kv(self.layer, k, v), ctx.batch, self.scale)
        return self.o_proj(o.reshape(n, self.num_heads * self.head_dim), ops)


class MLP(nn.Module):
    """SwiGLU MLP. ``down_proj`` reduces in the canonical chunk order (``RowLinear``) unless the MLP is
    an expert (``expert=True``: a plain linear)."""

    def __init__(self, hidden: int, intermediate: int, expert: bool = False) -> None:
        super().__init__()
        self.gate_proj = Linear(hidden, intermediate)
        self.up_proj = Linear(hidden, intermediate)
        self.down_proj = Linear(intermediate, hidden) if expert else RowLinear(intermediate, hidden)

    def forward(self, x: Tensor, ops: Backend) -> Tensor:
        gate, up = project(x, ops, self.gate_proj, self.up_proj)
        return self.down_proj(ops.swiglu(gate, up), ops)


class SparseMoE(nn.Module):
    """Router (fp32 logits) -> top-k -> experts as Linear on gathered rows -> rank-ordered combine.
    Experts are keyed by their id (``experts.<id>``), so a module holding some of them (expert
    parallel, ``onpolicy.parallel.parallelize``) keeps their parameter names."""

    def __init__(self, cfg: ModelConfig, experts: range | None = None) -> None:
        super().__init__()
        self.top_k, self.normalize, self.num_experts = cfg.num_experts_per_tok, cfg.norm_topk_prob, cfg.num_experts
        self.gate = Linear(cfg.hidden_size, cfg.num_experts)
        self.experts = nn.ModuleDict({str(e): MLP(cfg.hidden_size, cfg.moe_intermediate_size, expert=True)
                                      for e in (experts if experts is not None else range(cfg.num_experts))})

    def forward(self, x: Tensor, ops: Backend) -> Tensor:
        routing = self.route(x, ops)
        return ops.moe_combine(self.expert_slots(x, routing, ops), routing)

    def route(self, x: Tensor, ops: Backend) -> MoERouting:
        router_logits = ops.linear(x.float(), self.gate.weight.float())
        return ops.moe_route(router_logits, self.top_k, self.normalize)

    def expert_slots(self, x: Tensor, routing: MoERouting, ops: Backend) -> Tensor:
        """``[N, k, H]``: every row's output of each of its top-k experts this module holds (0 elsewhere)."""
        out = x.new_zeros((x.shape[0], self.top_k, x.shape[1]))
        for e, rows, ranks in dispatch(routing, self.num_experts):
            if str(e) in self.experts:
                out[rows, ranks] = self.experts[str(e)](x[rows], ops)
        return out


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn: Attention = Attention(cfg, layer)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp: nn.Module = SparseMoE(cfg) if cfg.is_moe_layer(layer) else MLP(cfg.hidden_size, cfg.intermediate_size)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, ctx: AttentionContext, ops: Backend) -> Tensor:
        x = x + self.self_attn(self.input_layernorm(x, ops), cos, sin, ctx, ops)
        return x + self.mlp(self.post_attention_layernorm(x, ops), ops)


def dense_stack(cfg: ModelConfig, layers: Sequence[nn.Module]) -> DenseStack | None:
    """The decoder ``layers`` as a ``DenseStack`` (their parameters, by reference) for
    ``Backend.decoder_stack``, or None when a layer is not exactly what it describes: a MoE layer, or
    a subclass of a module here (whose own ``forward`` the stack would skip), as the sharded modules
    of ``onpolicy.parallel.parallelize`` are."""
    if not layers:
        return None
    out: list[DenseLayer] = []
    for layer in layers:
        if type(layer) is not DecoderLayer:
            return None
        attn, mlp = layer.self_attn, layer.mlp
        exact = (type(attn) is Attention and type(mlp) is MLP and type(attn.o_proj) is RowLinear
                 and type(mlp.down_proj) is RowLinear and attn.o_proj.group is SINGLE and mlp.down_proj.group is SINGLE
                 and all(type(p) is Linear for p in (attn.q_proj, attn.k_proj, attn.v_proj, mlp.gate_proj, mlp.up_proj))
                 and all(type(n) is RMSNorm for n in (layer.input_layernorm, layer.post_attention_layernorm,
                                                       attn.q_norm, attn.k_norm) if n is not None))
        if not exact:
            return None
        out.append(DenseLayer(
            input_norm=layer.input_layernorm.weight, q=attn.q_proj.weight, k=attn.k_proj.weight, v=attn.v_proj.weight,
            q_bias=attn.q_proj.bias, k_bias=attn.k_proj.bias, v_bias=attn.v_proj.bias,
            q_norm=attn.q_norm.weight if attn.q_norm is not None else None,
            k_norm=attn.k_norm.weight if attn.k_norm is not None else None,
            o=attn.o_proj, o_bias=attn.o_proj.bias, post_norm=layer.post_attention_layernorm.weight,
            gate=mlp.gate_proj.weight, up=mlp.up_proj.weight, down=mlp.down_proj))
    first = layers[0].self_attn
    assert isinstance(first, Attention)
    return DenseStack(tuple(out), first.num_heads, first.num_kv_heads, first.head_dim, cfg.rms_norm_eps, first.scale)
