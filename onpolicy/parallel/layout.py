"""``Layout``: how tensor-parallel (TP) and expert-parallel (EP) ranks map onto one world, and which
slice of every weight a rank holds.

One world of ``world`` ranks serves both degrees: ``world`` is a multiple of ``tp`` and of ``ep``
(``world = max(tp, ep)`` when both are powers of two). Rank ``r`` holds TP shard ``r % tp`` and EP
shard ``r % ep``: the first ``tp`` ranks are one complete TP replica, ranks ``tp..2tp-1`` the next,
and likewise for EP. Collectives run over the whole world and keep shards ``0..degree-1`` (a
replica computes the same bits as the shard it repeats), so no sub-groups are needed and the
rollout and trainer layouts can share one process group whatever their degrees.

Sharding (Megatron-style, heads contiguous): attention heads are split across TP ranks; when
``tp > num_kv_heads`` each rank keeps the one KV head its query heads use (KV heads replicated).
``q/k/v/gate/up`` are column-parallel (a rank holds output rows), ``o_proj``/``down_proj`` are
row-parallel (a rank holds input columns = ``reduce_chunks / tp`` canonical chunks). Experts are
split contiguously across EP ranks and are not TP-sharded. Embedding, norms, router and LM head are
replicated.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from onpolicy.models.causal_lm import check_reduce_chunks

if TYPE_CHECKING:
    from onpolicy.models.config import ModelConfig


@dataclass(frozen=True)
class Layout:
    """The parallel degrees of one engine and this process's place in the world."""

    tp: int = 1
    ep: int = 1
    rank: int = 0
    world: int = 1

    def __post_init__(self) -> None:
        for name in ("tp", "ep", "world"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {v!r}")
        if not 0 <= self.rank < self.world:
            raise ValueError(f"rank {self.rank} is outside the world of {self.world}")
        if self.world % self.tp or self.world % self.ep:
            raise ValueError(f"world size {self.world} must be a multiple of tp={self.tp} and ep={self.ep}")

    @property
    def tp_rank(self) -> int:
        return self.rank % self.tp

    @property
    def ep_rank(self) -> int:
        return self.rank % self.ep


def check_degrees(cfg: ModelConfig, tp: int, ep: int, reduce_chunks: int) -> None:
    """Raise ``ValueError`` naming the first reason the model cannot run at these degrees."""
    if tp < 1 or ep < 1:
        raise ValueError(f"parallel degrees must be >= 1 (tp={tp}, ep={ep})")
    if reduce_chunks % tp:
        raise ValueError(f"tp={tp} must divide the canonical reduce_chunks={reduce_chunks}")
    if cfg.num_heads % tp:
        raise ValueError(f"tp={tp} must divide the {cfg.num_heads} attention heads")
    if cfg.num_kv_heads % tp and tp % cfg.num_kv_heads:
        raise ValueError(f"tp={tp} and the {cfg.num_kv_heads} KV heads must divide one another")
    check_reduce_chunks(cfg, reduce_chunks)
    if ep > 1:
        if not cfg.num_experts:
            raise ValueError(f"ep={ep} needs a mixture-of-experts model ({cfg.family} has no experts)")
        if cfg.num_experts % ep:
            raise ValueError(f"ep={ep} must divide the {cfg.num_experts} experts")


@dataclass(frozen=True)
class HeadShard:
    """Query heads ``[q_start, q_start + q_count)`` and KV heads ``[kv_start, kv_start + kv_count)``."""

    q_start: int
    q_count: int
    kv_start: int
    kv_count: int


def head_shard(cfg: ModelConfig, tp: int, index: int) -> HeadShard:
    """The attention heads TP shard ``index`` of ``tp`` holds (KV heads replicated when tp > KV heads)."""
    hq = cfg.num_heads // tp
    if tp <= cfg.num_kv_heads:
        hkv = cfg.num_kv_heads // tp
        return HeadShard(index * hq, hq, index * hkv, hkv)
    group = cfg.num_heads // cfg.num_kv_heads
    return HeadShard(index * hq, hq, index * hq // group, 1)
