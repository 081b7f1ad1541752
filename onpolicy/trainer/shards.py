"""The trainer's state on a tensor/expert-parallel model: the gradient-norm clip every rank agrees
on, and AdamW state moved between one rank's shard and the unsharded layout of checkpoints.

**Clipping.** A sharded rank holds only part of the gradient, so ``torch.nn.utils.clip_grad_norm_``
would see a partial norm (and replicas would clip differently). ``clip_sharded_grad_norm`` gathers
every rank's per-parameter norms (one small all-gather), and every rank computes the same total from
the same numbers: a TP-split parameter's norm is the 2-norm of its shards' norms in shard order, an
expert's is its owner's, a replicated parameter's is rank 0's; the total is the 2-norm of those in
the unsharded model's parameter order, as ``clip_grad_norm_`` computes it. So every rank applies the
same coefficient (replicated weights stay identical) and the total equals TP=1's up to rounding.

**Optimizer state.** Checkpoints hold AdamW's ``state_dict`` as an unsharded model's would be
(parameter indices in ``full_parameter_names`` order), so a checkpoint written at any degrees
restores at any other. ``named_state`` / ``indexed_state`` convert between index- and name-keyed
state; the moments shard and unshard with their parameter (``onpolicy.models.sharding``).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from onpolicy.models.causal_lm import CausalLM
from onpolicy.models.sharding import expert_owner, placement, shard_tensor, unshard_state_dict

NamedState = dict[str, dict[str, Any]]
"""Optimizer state per parameter name (AdamW: ``step``, ``exp_avg``, ``exp_avg_sq``)."""


def is_sharded(model: CausalLM) -> bool:
    return model.parallel.tp.degree > 1 or model.parallel.ep.degree > 1


def full_parameters(model: CausalLM) -> dict[str, tuple[int, ...]]:
    """Name -> shape of every parameter of the unsharded model, in its parameter order."""
    if not is_sharded(model):
        return {n: tuple(p.shape) for n, p in model.named_parameters()}
    with torch.device("meta"):
        full = CausalLM(model.config, model.ops)
    return {n: tuple(p.shape) for n, p in full.named_parameters()}


# ---------------------------------------------------------------------------- clipping
def _owner_rank(name: str, model: CausalLM) -> int | None:
    """The rank whose norm stands for replicated or expert parameter ``name`` (``None``: TP-split)."""
    where = placement(name, model.config, model.parallel.tp.degree)
    if where.group == "ep":
        return expert_owner(model.config, model.parallel.ep.degree, where.expert)
    return None if where.group == "tp" else 0


def rank_parameter_names(model: CausalLM) -> list[list[str]]:
    """Every rank's parameter names in rank order (a collective: every rank calls it together)."""
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, [n for n, _ in model.named_parameters()])
    return out


def clip_sharded_grad_norm(model: CausalLM, max_norm: float, names: Sequence[str],
                           rank_names: Sequence[Sequence[str]]) -> float:
    """Clip the gradients of sharded ``model`` to a total 2-norm of ``max_norm`` (``inf``: only
    measure) consistently on every rank (every rank calls this together); ``names``: the unsharded
    model's parameter order, ``rank_names``: ``rank_parameter_names(model)``. Returns the total norm
    (``nan``/``inf`` when a gradient is not finite)."""
    local = dict(model.named_parameters())
    mine = torch.stack([torch.linalg.vector_norm(p.grad.float(), 2) if p.grad is not None
                        else p.new_zeros((), dtype=torch.float32) for p in local.values()])
    parts = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, mine)
    index = [{n: i for i, n in enumerate(names_r)} for names_r in rank_names]
    tp = model.parallel.tp.degree
    norms = []
    for name in names:
        owner = _owner_rank(name, model)
        if owner is None:
            norms.append(torch.linalg.vector_norm(torch.stack([parts[r][index[r][name]] for r in range(tp)]), 2))
        else:
            norms.append(parts[owner][index[owner][name]])
    total = torch.linalg.vector_norm(torch.stack(norms), 2)
    if math.isfinite(max_norm):
        coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        for p in local.values():
            if p.grad is not None:
                p.grad.mul_(coef.to(p.grad.dtype))
    return float(total)


# ---------------------------------------------------------------------------- optimizer state
def named_state(state_dict: Mapping[str, Any], names: Sequence[str]) -> tuple[NamedState, dict[str, Any]]:
    """An optimizer ``state_dict`` (one parameter group over ``names`` in order) as per-name state and
    the group's hyperparameters."""
    (group,) = state_dict["param_groups"]
    ids = list(group["params"])
    if len(ids) != len(names):
        raise ValueError(f"optimizer state covers {len(ids)} parameters, the model has {len(names)}")
    by_id = dict(zip(ids, names, strict=True))
    hyper = {k: v for k, v in group.items() if k != "params"}
    return {by_id[i]: dict(s) for i, s in state_dict["state"].items()}, hyper


def indexed_state(named: NamedState, hyper: Mapping[str, Any], names: Sequence[str]) -> dict[str, Any]:
    """The inverse of ``named_state``: a ``state_dict`` over ``names`` (indices in that order)."""
    return {"state": {i: named[n] for i, n in enumerate(names) if n in named},
            "param_groups": [{**hyper, "params": list(range(len(names)))}]}


def shard_optimizer_state(named: NamedState, model: CausalLM) -> NamedState:
    """This rank's part of unsharded per-name optimizer state (the moments split like their parameter)."""
    if not is_sharded(model):
        return named
    out: NamedState = {}
    for name, st in named.items():
        where = placement(name, model.config, model.parallel.tp.degree)
        if where.group == "ep" and _owner_rank(name, model) != model.parallel.ep.index:
            continue  # another EP shard's expert
        out[name] = {k: shard_tensor(v, where, model.config, model.parallel) if _shaped(v) else v
                     for k, v in st.items()}
    return out


def _shaped(v: Any) -> bool:
    """A per-element state entry (a moment), as opposed to a scalar such as AdamW's ``step``."""
    return isinstance(v, Tensor) and v.dim() > 0


def unshard_optimizer_state(parts: Sequence[NamedState], model: CausalLM, names: Sequence[str]) -> NamedState:
    """Unsharded per-name optimizer state from every rank's ``parts`` (rank order)."""
    if not is_sharded(model):
        return parts[0]
    tp, ep = model.parallel.tp.degree, model.parallel.ep.degree
    keys = sorted({k for p in parts for st in p.values() for k, v in st.items() if _shaped(v)})
    by_key = {k: unshard_state_dict([{n: st[k] for n, st in p.items() if k in st} for p in parts],
                                    model.config, tp, ep, names) for k in keys}
    out: NamedState = {}
    for name in names:
        owner = parts[_owner_rank(name, model) or 0]
        if name not in owner:
            continue
        out[name] = {k: by_key[k][name] if _shaped(v) else v for k, v in owner[name].items()}
    return out
