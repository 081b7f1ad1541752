"""Where every weight of a tensor/expert-parallel model lives, and the two directions between a full
(HF-named) state dict and one rank's shard: ``shard_state_dict`` and ``unshard_state_dict``.

``placement`` is the one rule both directions follow (Megatron-style, heads contiguous, see
``onpolicy.parallel.layout``): ``q/k/v/gate/up`` are split over the TP group into equal contiguous
blocks of output rows (dim 0), ``o_proj``/``down_proj`` weights into blocks of input columns (dim 1);
``k/v_proj`` stay whole when the TP degree exceeds the KV heads (the layer slices its KV head), a
row-parallel bias is added once and so is replicated; experts are split contiguously over the EP
group (parameter names keep the global expert id); everything else is replicated. The same rule
shards an optimizer's per-parameter state (AdamW moments have their parameter's shape), so a
trainer's checkpoint is written in the layout of an unsharded model whatever its degrees, and any
degree can restore it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from onpolicy.kernels.backend import ModelParallel

from .config import ModelConfig

_COLUMN = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")
_ROW = ("o_proj", "down_proj")


@dataclass(frozen=True)
class Placement:
    """``group`` "tp": split in ``tp`` equal blocks along ``dim``; "ep": held whole by the EP shard
    owning expert ``expert``; "": replicated on every rank."""

    group: str = ""
    dim: int = 0
    expert: int = -1


REPLICATED = Placement()


def placement(name: str, cfg: ModelConfig, tp: int) -> Placement:
    """Where the full parameter ``name`` lives under a TP degree ``tp`` (any EP degree)."""
    parts = name.split(".")
    if "experts" in parts:
        return Placement("ep", expert=int(parts[parts.index("experts") + 1]))
    module = parts[-2] if len(parts) >= 2 else ""
    if tp == 1 or module not in _COLUMN + _ROW:
        return REPLICATED
    if module in ("k_proj", "v_proj") and tp > cfg.num_kv_heads:
        return REPLICATED
    if module in _ROW:
        return Placement("tp", dim=1) if parts[-1] == "weight" else REPLICATED
    return Placement("tp", dim=0)


def expert_owner(cfg: ModelConfig, ep: int, expert: int) -> int:
    """The EP shard holding ``expert``."""
    return expert // (cfg.num_experts // ep)


def shard_tensor(t: Tensor, where: Placement, cfg: ModelConfig, par: ModelParallel) -> Tensor | None:
    """This rank's part of a full tensor placed at ``where`` (``None``: an expert another rank holds).
    Sliced tensors are contiguous copies; the rest are ``t`` itself."""
    if where.group == "ep":
        return t if expert_owner(cfg, par.ep.degree, where.expert) == par.ep.index else None
    if where.group == "tp":
        return t.tensor_split(par.tp.degree, where.dim)[par.tp.index].contiguous()
    return t


def shard_state_dict(state: Mapping[str, Tensor], cfg: ModelConfig, par: ModelParallel) -> dict[str, Tensor]:
    """This rank's slice of a full (HF-named) state dict under ``par``."""
    if par.tp.degree == 1 and par.ep.degree == 1:
        return dict(state)
    out: dict[str, Tensor] = {}
    for name, t in state.items():
        mine = shard_tensor(t, placement(name, cfg, par.tp.degree), cfg, par)
        if mine is not None:
            out[name] = mine
    return out


def unshard_state_dict(parts: Sequence[Mapping[str, Tensor]], cfg: ModelConfig, tp: int, ep: int,
                       names: Sequence[str]) -> dict[str, Tensor]:
    """The full state dict (keys ``names``, in that order) from every rank's shard: ``parts[r]`` is
    rank ``r``'s (ranks ``0..tp-1`` hold TP shards ``0..tp-1``, ranks ``0..ep-1`` EP shards
    ``0..ep-1``, see ``Layout``). A name no rank holds is left out (e.g. optimizer state of a
    parameter that never had a gradient)."""
    out: dict[str, Tensor] = {}
    for name in names:
        where = placement(name, cfg, tp)
        if where.group == "tp":
            blocks = [p[name] for p in parts[:tp] if name in p]
            if blocks:
                if len(blocks) != tp:
                    raise ValueError(f"{name}: {len(blocks)} of {tp} tensor-parallel shards present")
                out[name] = torch.cat(blocks, where.dim)
        elif where.group == "ep":
            owner = parts[expert_owner(cfg, ep, where.expert)]
            if name in owner:
                out[name] = owner[name]
        elif name in parts[0]:
            out[name] = parts[0][name]
    return out
