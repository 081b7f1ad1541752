"""The process group (gloo over loopback) and the autograd-aware collectives of a sharded model.

``init_loopback`` joins a world on ``127.0.0.1`` with a timeout on every collective, so a dead rank
makes the others fail instead of hang. ``GlooShardGroup`` implements ``ShardGroup`` (the operators'
view of a TP or EP group) over the whole world: it gathers every rank's tensor and keeps shards
``0..degree-1`` (see ``layout`` for why replicas need no sub-group). Every collective is an
``autograd.Function`` with the backward the training path needs when everything downstream of it is
replicated (the loss is computed identically on every rank):

- ``gather``: exact concatenation; backward hands each rank the gradient of its own part.
- ``all_reduce`` (fast backend only): plain sum; backward is the identity.
- ``enter``: identity; backward sums the gradient over shards ``0..degree-1`` in shard order.
"""

from __future__ import annotations

import os
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from onpolicy.kernels.backend import SINGLE, ModelParallel, ShardGroup

from .layout import Layout

DEFAULT_TIMEOUT_S = 120.0


def init_loopback(rank: int, world: int, port: int, timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
    """Join the gloo world of ``world`` ranks rendezvousing on ``127.0.0.1:port``. A process joins one
    world at most: a rank of a parallel engine needs its own process."""
    if dist.is_initialized():
        raise RuntimeError("this process already has a torch.distributed group; a parallel engine's rank needs "
                           "its own process")
    if os.path.exists("/sys/class/net/lo"):
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=timeout_s))


def _world_parts(t: Tensor) -> list[Tensor]:
    t = t.contiguous()
    parts = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, t)
    return parts


def _sum_in_order(parts: list[Tensor]) -> Tensor:
    acc = parts[0]
    for p in parts[1:]:
        acc = acc + p
    return acc


class _Gather(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, t: Tensor, degree: int) -> Tensor:
        ctx.rows, ctx.index = t.shape[0], dist.get_rank() % degree
        return torch.cat(_world_parts(t)[:degree])

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        return grad[ctx.index * ctx.rows:(ctx.index + 1) * ctx.rows], None


class _AllReduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, t: Tensor, degree: int) -> Tensor:
        if degree == dist.get_world_size():
            out = t.clone()
            dist.all_reduce(out)
            return out
        return _sum_in_order(_world_parts(t)[:degree])

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        return grad, None


class _Enter(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, t: Tensor, degree: int) -> Tensor:
        ctx.degree = degree
        return t.view_as(t)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        return _sum_in_order(_world_parts(grad)[:ctx.degree]), None


class GlooShardGroup:
    """A TP or EP group of ``degree`` shards over the current torch.distributed world."""

    def __init__(self, degree: int, index: int) -> None:
        self.degree, self.index = degree, index

    def gather(self, t: Tensor) -> Tensor:
        return _Gather.apply(t, self.degree)

    def all_reduce(self, t: Tensor) -> Tensor:
        return _AllReduce.apply(t, self.degree)

    def enter(self, t: Tensor) -> Tensor:
        return _Enter.apply(t, self.degree) if torch.is_grad_enabled() else t


def shard_group(degree: int, index: int) -> ShardGroup:
    """``SINGLE`` for degree 1, else a ``GlooShardGroup`` (the world must be initialised)."""
    if degree == 1:
        return SINGLE
    if not dist.is_initialized():
        raise RuntimeError(f"a parallel degree of {degree} needs an initialised process group (init_loopback)")
    return GlooShardGroup(degree, index)


def model_parallel(layout: Layout) -> ModelParallel:
    """The groups of ``layout`` in the current world."""
    if layout.world > 1 and (not dist.is_initialized() or dist.get_world_size() != layout.world
                             or dist.get_rank() != layout.rank):
        raise RuntimeError(f"layout {layout} does not match the initialised process group")
    return ModelParallel(tp=shard_group(layout.tp, layout.tp_rank), ep=shard_group(layout.ep, layout.ep_rank))
