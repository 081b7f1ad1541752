"""Tensor and expert parallelism applied to a model from outside: ``parallelize`` swaps the plain
modules of ``onpolicy.models.layers`` for the sharded subclasses below (the model code itself has no
parallelism), and ``shard_model`` does it for a loaded model, keeping this rank's shard of its
weights.

Megatron-style, heads contiguous (``onpolicy.parallel.layout``): attention heads and MLP columns are
split over the TP group — ``q/k/v/gate/up`` column-parallel, ``o_proj``/``down_proj`` row-parallel,
reduced in the canonical chunk order (``Backend.row_linear``) as the unsharded model already reduces
them — and experts over the EP group. Every collective is the group's (``ShardGroup``): ``enter``
where a replicated input enters sharded compute (its gradient is summed over the group), ``gather``
for the experts' slots. So a sharded model's logprobs are bitwise those of the unsharded one.
"""

from __future__ import annotations

from dataclasses import replace

import torch
from torch import Tensor

from onpolicy.kernels import Backend
from onpolicy.kernels.backend import ModelParallel, MoERouting, ShardGroup
from onpolicy.models.causal_lm import CausalLM
from onpolicy.models.config import ModelConfig
from onpolicy.models.layers import MLP, Attention, Linear, RMSNorm, RowLinear, SparseMoE
from onpolicy.models.loading import LoadedModel
from onpolicy.models.sharding import shard_state_dict

from .layout import check_degrees, head_shard


class SharedRMSNorm(RMSNorm):
    """An RMSNorm whose replicated weight is applied to rows sharded over ``group`` (the per-head q/k
    norms under TP): its gradient is summed over the group."""

    def __init__(self, dim: int, eps: float, group: ShardGroup) -> None:
        super().__init__(dim, eps)
        self.group = group

    def forward(self, x: Tensor, ops: Backend) -> Tensor:
        return ops.rmsnorm(x, self.group.enter(self.weight), self.eps)


class TensorParallelAttention(Attention):
    """This rank's heads of an attention layer. With more TP ranks than KV heads, ``k/v_proj`` stay
    whole (replicated) and the rank projects its one KV head through a row slice of the weight, whose
    gradient is summed over the group."""

    def __init__(self, cfg: ModelConfig, layer: int, tp: ShardGroup) -> None:
        super().__init__(cfg, layer)
        self.tp = tp
        heads = head_shard(cfg, tp.degree, tp.index)
        self.num_heads, self.num_kv_heads = heads.q_count, heads.kv_count
        replicated_kv = tp.degree > cfg.num_kv_heads
        kv_rows = (cfg.num_kv_heads if replicated_kv else self.num_kv_heads) * cfg.head_dim
        self.kv_slice = (slice(heads.kv_start * cfg.head_dim, (heads.kv_start + 1) * cfg.head_dim)
                         if replicated_kv else None)
        self.q_proj = Linear(cfg.hidden_size, self.num_heads * cfg.head_dim, cfg.qkv_bias)
        self.k_proj = Linear(cfg.hidden_size, kv_rows, cfg.qkv_bias)
        self.v_proj = Linear(cfg.hidden_size, kv_rows, cfg.qkv_bias)
        self.o_proj = RowLinear(cfg.num_heads * cfg.head_dim, cfg.hidden_size, tp, cfg.o_bias)
        self.q_norm = SharedRMSNorm(cfg.head_dim, cfg.rms_norm_eps, tp) if cfg.qk_norm else None
        self.k_norm = SharedRMSNorm(cfg.head_dim, cfg.rms_norm_eps, tp) if cfg.qk_norm else None

    def project_qkv(self, x: Tensor, ops: Backend) -> tuple[Tensor, Tensor, Tensor]:
        x = self.tp.enter(x)
        if self.kv_slice is None:
            return super().project_qkv(x, ops)
        return self.q_proj(x, ops), self._kv_slice(self.k_proj, x, ops), self._kv_slice(self.v_proj, x, ops)

    def _kv_slice(self, proj: Linear, x: Tensor, ops: Backend) -> Tensor:
        assert self.kv_slice is not None
        y = ops.linear(x, self.tp.enter(proj.weight)[self.kv_slice])
        return y if proj.bias is None else y + self.tp.enter(proj.bias)[self.kv_slice]


class TensorParallelMLP(MLP):
    """This rank's columns of a SwiGLU MLP; ``down_proj`` row-parallel."""

    def __init__(self, hidden: int, intermediate: int, tp: ShardGroup) -> None:
        super().__init__(hidden, intermediate // tp.degree)
        self.tp = tp
        self.down_proj = RowLinear(intermediate, hidden, tp)

    def forward(self, x: Tensor, ops: Backend) -> Tensor:
        return super().forward(self.tp.enter(x), ops)


class ExpertParallelMoE(SparseMoE):
    """This rank's experts ``[index * E/ep, (index + 1) * E/ep)``: it fills the ``[N, k, H]`` slots
    routed to them; the slots of every EP shard are gathered and each slot is taken from the shard
    owning its expert (pure indexing, no floating-point sum), then combined in top-k rank order."""

    def __init__(self, cfg: ModelConfig, ep: ShardGroup) -> None:
        per_shard = cfg.num_experts // ep.degree
        super().__init__(cfg, range(ep.index * per_shard, (ep.index + 1) * per_shard))
        self.ep, self.per_shard = ep, per_shard

    def expert_slots(self, x: Tensor, routing: MoERouting, ops: Backend) -> Tensor:
        out = super().expert_slots(self.ep.enter(x), routing, ops)
        slots = self.ep.gather(out[None])  # [ep, N, k, H]
        owner = routing.experts // self.per_shard
        n, k = routing.experts.shape
        return slots[owner, torch.arange(n, device=x.device)[:, None], torch.arange(k, device=x.device)[None, :]]


def parallelize(model: CausalLM, par: ModelParallel) -> CausalLM:
    """``model`` made this rank's shard under ``par``, in place: each attention and dense MLP swapped for
    its tensor-parallel module when ``par.tp`` has more than one shard, each MoE layer for its
    expert-parallel one when ``par.ep`` has. The new modules' parameters are fresh (made on the current
    default device, e.g. ``meta``): load this rank's shard of the weights into them
    (``shard_state_dict``). ``ValueError`` names why the model cannot run at these degrees."""
    cfg, tp, ep = model.config, par.tp, par.ep
    check_degrees(cfg, tp.degree, ep.degree, model.ops.config.reduce_chunks)
    for i, layer in enumerate(model.model.layers):
        if tp.degree > 1:
            layer.self_attn = TensorParallelAttention(cfg, i, tp)
            if not cfg.is_moe_layer(i):
                layer.mlp = TensorParallelMLP(cfg.hidden_size, cfg.intermediate_size, tp)
        if ep.degree > 1 and cfg.is_moe_layer(i):
            layer.mlp = ExpertParallelMoE(cfg, ep)
    model.parallel = par
    return model


def shard_model(lm: LoadedModel, par: ModelParallel) -> LoadedModel:
    """``lm`` rebuilt to hold this rank's shard under ``par`` (same name, tokenizer and checksum,
    which name the full weights)."""
    with torch.device("meta"):
        model = parallelize(CausalLM(lm.config, lm.model.ops), par)
    model.load_state_dict(shard_state_dict(lm.model.state_dict(), lm.config, par), assign=True)
    model.requires_grad_(False)
    return replace(lm, model=model.to_device(lm.model.device))

