"""Decoder building blocks. Every numerical step calls an operator of the ``Backend`` passed in;
no layer does arithmetic of its own beyond residual adds (exact elementwise).

Under tensor/expert parallelism (``onpolicy.parallel``) a layer holds its rank's shard: attention
heads and MLP columns are split over the TP group (``q/k/v/gate/up`` column-parallel, ``o_proj`` and
``down_proj`` row-parallel through ``Backend.row_linear``), experts over the EP group. With
``ModelParallel()`` (the default) every group is ``SINGLE`` and nothing is sharded — but the
row-parallel linears still reduce in the canonical chunk order, so every degree gives the same bits.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import Tensor, nn

from onpolicy.kernels import Backend
from onpolicy.kernels.backend import DenseLayer, DenseStack, ShardGroup, chunk_major
from onpolicy.kernels.spec.moe import dispatch
from onpolicy.parallel.layout import ModelParallel, head_shard

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
    """A row-parallel linear: ``weight [Out, K_local]`` is this rank's slice of the input dim; the
    output, reduced over ``group`` in the canonical chunk order, is full and replicated."""

    def __init__(self, in_features: int, out_features: int, group: ShardGroup, bias: bool = False) -> None:
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
    """RMSNorm. ``shared`` names the group over which a replicated weight is applied to sharded rows
    (the per-head q/k norms under TP): its gradient is then summed over that group."""

    def __init__(self, dim: int, eps: float, shared: ShardGroup | None = None) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps
        self.shared = shared

    def forward(self, x: Tensor, ops: Backend) -> Tensor:
        w = self.weight if self.shared is None else self.shared.enter(self.weight)
        return ops.rmsnorm(x, w, self.eps)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int, par: ModelParallel) -> None:
        super().__init__()
        self.layer, self.tp = layer, par.tp
        heads = head_shard(cfg, par.tp.degree, par.tp.index)
        self.num_heads, self.num_kv_heads, self.head_dim = heads.q_count, heads.kv_count, cfg.head_dim
        self.q_proj = Linear(cfg.hidden_size, self.num_heads * cfg.head_dim, cfg.qkv_bias)
        # More TP ranks than KV heads: k/v_proj stay whole (replicated) and a rank projects its one
        # KV head through a row slice of the weight, whose gradient is summed over the TP group.
        kv_rows = (cfg.num_kv_heads if par.tp.degree > cfg.num_kv_heads else self.num_kv_heads) * cfg.head_dim
        self.kv_slice = (slice(heads.kv_start * cfg.head_dim, (heads.kv_start + 1) * cfg.head_dim)
                         if par.tp.degree > cfg.num_kv_heads else None)
        self.k_proj = Linear(cfg.hidden_size, kv_rows, cfg.qkv_bias)
        self.v_proj = Linear(cfg.hidden_size, kv_rows, cfg.qkv_bias)
        self.o_proj = RowLinear(cfg.num_heads * cfg.head_dim, cfg.hidden_size, par.tp, cfg.o_bias)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, par.tp) if cfg.qk_norm else None
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, par.tp) if cfg.qk_norm else None
        self.scale = 1.0 / math.sqrt(cfg.head_dim)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, ctx: AttentionContext, ops: Backend) -> Tensor:
        n = x.shape[0]
        x = self.tp.enter(x)
        if self.kv_slice is None:
            q, k, v = project(x, ops, self.q_proj, self.k_proj, self.v_proj)
        else:
            q, k, v = self.q_proj(x, ops), self._kv_slice(self.k_proj, x, ops), self._kv_slice(self.v_proj, x, ops)
        q = q.view(n, self.num_heads, self.head_dim)
        k, v = k.view(n, self.num_kv_heads, self.head_dim), v.view(n, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q, ops), self.k_norm(k, ops)
        q, k = ops.rope(q, cos, sin), ops.rope(k, cos, sin)
        o = ops.attention(q, ctx.kv(self.layer, k, v), ctx.batch, self.scale)
        return self.o_proj(o.reshape(n, self.num_heads * self.head_dim), ops)

    def _kv_slice(self, proj: Linear, x: Tensor, ops: Backend) -> Tensor:
        assert self.kv_slice is not None
        y = ops.linear(x, self.tp.enter(proj.weight)[self.kv_slice])
        return y if proj.bias is None else y + self.tp.enter(proj.bias)[self.kv_slice]


class MLP(nn.Module):
    """SwiGLU MLP. With a ``tp`` group it is tensor-parallel (``down_proj`` row-parallel, canonical
    reduction even at degree 1); without one (MoE experts, which are not TP-sharded) it is plain."""

    def __init__(self, hidden: int, intermediate: int, tp: ShardGroup | None = None) -> None:
        super().__init__()
        self.tp = tp
        local = intermediate // tp.degree if tp is not None else intermediate
        self.gate_proj = Linear(hidden, local)
        self.up_proj = Linear(hidden, local)
        self.down_proj = Linear(intermediate, hidden) if tp is None else RowLinear(intermediate, hidden, tp)

    def forward(self, x: Tensor, ops: Backend) -> Tensor:
        if self.tp is not None:
            x = self.tp.enter(x)
        gate, up = project(x, ops, self.gate_proj, self.up_proj)
        return self.down_proj(ops.swiglu(gate, up), ops)


class SparseMoE(nn.Module):
    """Router (fp32 logits) -> top-k -> experts as Linear on gathered rows -> rank-ordered combine.

    Under expert parallelism a rank holds experts ``[index * E/ep, (index + 1) * E/ep)`` (keyed by
    their global id, so parameter names do not change) and fills the ``[N, k, H]`` slots routed to
    them; the slots of all EP shards are gathered and each slot is taken from the shard owning its
    expert (pure indexing, no floating-point sum), then combined in top-k rank order as usual."""

    def __init__(self, cfg: ModelConfig, ep: ShardGroup) -> None:
        super().__init__()
        self.top_k, self.normalize, self.num_experts = cfg.num_experts_per_tok, cfg.norm_topk_prob, cfg.num_experts
        self.ep = ep
        self.per_shard = cfg.num_experts // ep.degree
        first = ep.index * self.per_shard
        self.gate = Linear(cfg.hidden_size, cfg.num_experts)
        self.experts = nn.ModuleDict({str(e): MLP(cfg.hidden_size, cfg.moe_intermediate_size)
                                      for e in range(first, first + self.per_shard)})

    def forward(self, x: Tensor, ops: Backend) -> Tensor:
        router_logits = ops.linear(x.float(), self.gate.weight.float())
        routing = ops.moe_route(router_logits, self.top_k, self.normalize)
        xin = self.ep.enter(x)
        out = x.new_zeros((x.shape[0], self.top_k, x.shape[1]))
        for e, rows, ranks in dispatch(routing, self.num_experts):
            if str(e) in self.experts:
                out[rows, ranks] = self.experts[str(e)](xin[rows], ops)
        if self.ep.degree > 1:
            slots = self.ep.gather(out[None])  # [ep, N, k, H]
            owner = routing.experts // self.per_shard
            n, k = routing.experts.shape
            out = slots[owner, torch.arange(n, device=x.device)[:, None], torch.arange(k, device=x.device)[None, :]]
        return ops.moe_combine(out, routing)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int, par: ModelParallel) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, layer, par)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp: nn.Module = (SparseMoE(cfg, par.ep) if cfg.is_moe_layer(layer)
                               else MLP(cfg.hidden_size, cfg.intermediate_size, par.tp))

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, ctx: AttentionContext, ops: Backend) -> Tensor:
        x = x + self.self_attn(self.input_layernorm(x, ops), cos, sin, ctx, ops)
        return x + self.mlp(self.post_attention_layernorm(x, ops), ops)


def dense_stack(cfg: ModelConfig, layers: Sequence[nn.Module], par: ModelParallel) -> DenseStack | None:
    """The decoder ``layers`` as a ``DenseStack`` (their parameters, by reference) for
    ``Backend.decoder_stack``, or None when a layer is not exactly what it describes: a MoE layer, a
    sharded model (tensor or expert parallel), K/V projected through a row slice, or a subclass of a
    module here (whose own ``forward`` the stack would skip)."""
    if par.tp.degree != 1 or par.ep.degree != 1 or not layers:
        return None
    out: list[DenseLayer] = []
    for layer in layers:
        if type(layer) is not DecoderLayer:
            return None
        attn, mlp = layer.self_attn, layer.mlp
        exact = (type(attn) is Attention and type(mlp) is MLP and type(attn.o_proj) is RowLinear
                 and type(mlp.down_proj) is RowLinear and attn.kv_slice is None
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
