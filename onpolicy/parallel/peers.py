"""Peer ranks as Ray actors: what ``MirroredRolloutEngine`` (rollout tp/ep), ``DataParallelEngine``
(trainer dp) and ``ModelParallelEngine`` (trainer tp/ep) share.

Rank 0 lives in the service's own process; ranks ``1..world-1`` are Ray actors started by
``start_peers`` (no restarts: a lost rank ends the whole engine, and the role actor's own restart
brings a fresh world), each loading the model with a ``Loader`` (``peer_model``) and joining the gloo
world on loopback (``groups.init_loopback``; ``sharded_peer_model`` also keeps the rank's shard).
``end_peers`` kills them; a peer already gone is ignored.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from typing import Any

from onpolicy.kernels import KernelConfig
from onpolicy.models.checkpoint import LoadedModel

from .layout import Layout

Loader = Callable[[str, KernelConfig], LoadedModel]
"""Loads a model reference on an operator set (e.g. ``onpolicy.services.common.model.load_certified``);
must be picklable (it travels to the peer actors)."""


def load_uncertified(model: str, kernel_config: KernelConfig) -> LoadedModel:
    """The default peer loader: ``model`` on ``kernel_config``'s backend, without the selftest."""
    from onpolicy.kernels import get_backend
    from onpolicy.models.registry import load_model

    return load_model(model, get_backend(kernel_config))


def peer_model(model: str, kernel_config: KernelConfig, threads: int, loader: Loader | None) -> LoadedModel:
    """What every peer rank's actor does first: Ray's environment, ``threads`` torch threads, and
    ``model`` loaded with ``loader`` (default ``load_uncertified``)."""
    import torch

    from onpolicy.services.cluster.local_ray import ray_env

    ray_env()
    torch.set_num_threads(threads)
    return (loader or load_uncertified)(model, kernel_config)


def sharded_peer_model(layout: Layout, port: int, model: str, kernel_config: KernelConfig, threads: int,
                       timeout_s: float, loader: Loader | None) -> LoadedModel:
    """``peer_model``, then join the gloo world of ``layout`` on ``port`` and keep this rank's shard."""
    from onpolicy.models.checkpoint import shard_model

    from .groups import init_loopback, model_parallel

    lm = peer_model(model, kernel_config, threads, loader)
    init_loopback(layout.rank, layout.world, port, timeout_s)
    return shard_model(lm, model_parallel(layout))


def start_peers(actor_cls: type, world: int, args: Callable[[int], Sequence[Any]], options: dict[str, Any],
                name: Callable[[int], str] | None = None) -> list[Any]:
    """Ray actors ``actor_cls(*args(rank))`` for ranks ``1..world-1`` with ``options`` (e.g. ``num_cpus``)
    and, when ``name`` is given, the actor name ``name(rank)``."""
    import ray

    remote = ray.remote(actor_cls)
    return [remote.options(max_restarts=0, **({"name": name(rank)} if name else {}), **options).remote(*args(rank))
            for rank in range(1, world)]


def end_peers(peers: Sequence[Any]) -> None:
    """Kill every peer actor (those already gone are skipped)."""
    import ray

    for p in peers:
        with contextlib.suppress(Exception):
            ray.kill(p)
