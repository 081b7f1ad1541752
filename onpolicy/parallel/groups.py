"""The process group of a parallel engine and the autograd-aware collectives of a sharded model.

``join_world`` joins a world of ranks meeting at rank 0's ``Rendezvous`` (its node's address and a
port free there: ``127.0.0.1`` when every rank runs on this machine, the node IP Ray reports on a
cluster), with a timeout on every collective, so a dead rank makes the others fail instead of hang.
Rank 0's store listens on that address only (``listen``), never on every interface. The collective
backend follows the device, in one place (``collective_backend``): gloo on CPU, HCCL on Ascend NPUs,
NCCL on CUDA; the canonical reduction order is ours on every backend (partials gathered, then
folded in order). ``GlooShardGroup`` implements ``ShardGroup`` (the operators'
view of a TP or EP group) over the whole world: it gathers every rank's tensor and keeps shards
``0..degree-1`` (see ``layout`` for why replicas need no sub-group). Every collective is an
``autograd.Function`` with the backward the training path needs when everything downstream of it is
replicated (the loss is computed identically on every rank):

- ``gather``: exact concatenation; backward hands each rank the gradient of its own part.
- ``all_reduce`` (fast backend only): plain sum; backward is the identity.
- ``enter``: identity; backward sums the gradient over shards ``0..degree-1`` in shard order.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import socket
import struct
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from onpolicy.kernels.backend import SINGLE, ModelParallel, ShardGroup

from .layout import Layout

DEFAULT_TIMEOUT_S = 120.0


LOOPBACK = "127.0.0.1"
_BACKENDS = {"cpu": "gloo", "npu": "hccl", "cuda": "nccl"}


def collective_backend(device: str) -> str:
    """The torch.distributed backend of a world whose tensors live on ``device`` (its type)."""
    kind = device.split(":")[0]
    if kind not in _BACKENDS:
        raise ValueError(f"no collective backend for device {device!r}; devices are {', '.join(_BACKENDS)}")
    return _BACKENDS[kind]


@dataclass(frozen=True)
class Rendezvous:
    """Where the ranks of one world meet: rank 0's store, at ``host:port``."""

    host: str
    port: int


def listen(host: str, port: int = 0) -> socket.socket:
    """A TCP socket listening on ``host`` only (``port`` 0: a free one; read it from ``getsockname``)."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.bind((host, port))
        sock.listen(64)
    except OSError:
        sock.close()
        raise
    return sock


def interface_of(host: str) -> str | None:
    """The network interface this machine reaches ``host`` through (``lo`` for a loopback address),
    for gloo's pair connections; None when it cannot tell (gloo then picks by hostname)."""
    if host.startswith("127."):
        return "lo" if os.path.exists("/sys/class/net/lo") else None
    with contextlib.suppress(OSError), socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        probe.connect((host, 9))  # no packet is sent: this only picks the route and the local address
        local = probe.getsockname()[0]
        for _, name in socket.if_nameindex():
            with contextlib.suppress(OSError):
                req = struct.pack("256s", name.encode()[:15])
                if socket.inet_ntoa(fcntl.ioctl(probe.fileno(), 0x8915, req)[20:24]) == local:  # SIOCGIFADDR
                    return name
    return None


def join_world(rank: int, world: int, where: Rendezvous, timeout_s: float = DEFAULT_TIMEOUT_S,
               device: str = "cpu", listener: socket.socket | None = None) -> None:
    """Join the world of ``world`` ranks meeting at ``where``; rank 0 serves the store there, on
    ``listener`` when given (a socket ``listen`` bound before the peers were told the port) or on one
    it binds now. A process joins one world at most: a rank of a parallel engine needs its own
    process."""
    if dist.is_initialized():
        raise RuntimeError("this process already has a torch.distributed group; a parallel engine's rank needs "
                           "its own process")
    timeout = timedelta(seconds=timeout_s)
    if rank == 0:
        sock = listener or listen(where.host, where.port)
        store = dist.TCPStore(where.host, where.port, world, True, timeout, wait_for_workers=False,
                              master_listen_fd=sock.detach())
    else:
        store = dist.TCPStore(where.host, where.port, world, False, timeout)
    backend = collective_backend(device)
    if backend == "gloo" and (ifname := interface_of(where.host)):
        os.environ.setdefault("GLOO_SOCKET_IFNAME", ifname)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world, timeout=timeout)


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
        raise RuntimeError(f"a parallel degree of {degree} needs an initialised process group (join_world)")
    return GlooShardGroup(degree, index)


def model_parallel(layout: Layout) -> ModelParallel:
    """The groups of ``layout`` in the current world."""
    if layout.world > 1 and (not dist.is_initialized() or dist.get_world_size() != layout.world
                             or dist.get_rank() != layout.rank):
        raise RuntimeError(f"layout {layout} does not match the initialised process group")
    return ModelParallel(tp=shard_group(layout.tp, layout.tp_rank), ep=shard_group(layout.ep, layout.ep_rank))
