"""Peer ranks as Ray actors: what ``MirroredRolloutEngine`` (rollout tp/ep), ``DataParallelEngine``
(trainer dp) and ``ModelParallelEngine`` (trainer tp/ep) share.

Rank 0 lives in the service's own process; ranks ``1..world-1`` are Ray actors started by
``start_peers`` (no restarts: a lost rank ends the whole engine, and the role actor's own restart
brings a fresh world), each loading the model with a ``Loader`` (``peer_model``) and joining the gloo
world on loopback (``groups.init_loopback``; ``sharded_peer_model`` also keeps the rank's shard).
``end_peers`` kills them; a peer already gone is ignored.

``Peers`` drives them from rank 0: ``mirror`` queues a call on every peer (Ray runs one caller's
calls to an actor in submission order, so the ranks meet in the same collectives), ``local`` runs
rank 0's part, ``settle`` waits for the peers' answers. A failed or dead peer becomes ``PeerFailed``
naming its rank ("trainer rank 1 of 2 failed: …"), after which every peer is ended — they may be
blocked in a collective — and the engine is unusable (``failed`` says why; its service must be
restarted, which brings a fresh world).
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
                name: str = "") -> list[Any]:
    """Ray actors ``actor_cls(*args(rank))`` for ranks ``1..world-1`` with ``options`` (e.g. ``num_cpus``),
    named ``{name}-{random}-rank{r}`` when ``name`` is given (a restarted service's new peers get new
    names while the old ones may still be ending)."""
    import secrets

    import ray

    remote = ray.remote(actor_cls)
    tag = f"{name}-{secrets.token_hex(3)}" if name else ""
    return [remote.options(max_restarts=0, **({"name": f"{tag}-rank{rank}"} if tag else {}), **options)
            .remote(*args(rank)) for rank in range(1, world)]


def end_peers(peers: Sequence[Any]) -> None:
    """Kill every peer actor (those already gone are skipped)."""
    import ray

    for p in peers:
        with contextlib.suppress(Exception):
            ray.kill(p)


class PeerFailed(RuntimeError):
    """A rank of a parallel engine failed or died; the engine has ended every peer."""


def _failure(kind: str, rank: int, world: int, e: BaseException) -> str:
    text = str(e).strip()
    return f"{kind} rank {rank} of {world} failed: {type(e).__name__}: {text.splitlines()[-1] if text else ''}"


class Peers:
    """Ranks ``1..world-1`` of a ``kind`` ("rollout", "trainer") engine, as driven by rank 0."""

    def __init__(self, kind: str, actors: list[Any], timeout_s: float) -> None:
        self.kind, self.actors, self.timeout_s = kind, actors, timeout_s
        self.world = len(actors) + 1
        self.failed = ""
        """Why the engine is unusable (a rank failed), "" while it runs."""
        self.owns_group = False
        """Whether rank 0 joined the gloo world for these peers (set once it has): ``close`` leaves it."""
        self._pending: list[tuple[int, Any]] = []

    def __bool__(self) -> bool:
        return bool(self.actors)

    def check(self) -> None:
        """Raise ``PeerFailed`` when a rank has failed before."""
        if self.failed:
            raise PeerFailed(self.failed)

    def mirror(self, method: str, *args: Any) -> None:
        """Queue ``method(*args)`` on every peer (after the calls queued before)."""
        self.check()
        self._pending += [(rank, getattr(p, method).remote(*args)) for rank, p in enumerate(self.actors, start=1)]

    def settle(self) -> list[Any]:
        """Every queued call's answer (rank order of the calls); a failure becomes ``PeerFailed``."""
        import ray

        pending, self._pending = self._pending, []
        out = []
        for rank, ref in pending:
            try:
                out.append(ray.get(ref, timeout=self.timeout_s))
            except BaseException as e:
                raise self.lost(_failure(self.kind, rank, self.world, e)) from e
        return out

    def local(self, fn: Callable[[], Any], alike: tuple[type[BaseException], ...] = ()) -> Any:
        """Run rank 0's part of a mirrored call. An ``alike`` error is one every rank raises the same
        way (a refused input): the peers' answers are awaited and it is re-raised. Any other failure:
        a failed peer is the likelier cause (a lost rank breaks the collectives), so name it when one
        has failed within a few seconds; either way end the peers."""
        import ray

        try:
            return fn()
        except alike:
            # the peers raise the same error (Ray's error for a remote ValueError is a ValueError):
            # the world is intact; a peer that failed otherwise is a lost rank
            pending, self._pending = self._pending, []
            for rank, ref in pending:
                try:
                    ray.get(ref, timeout=self.timeout_s)
                except alike:
                    pass
                except BaseException as peer_error:
                    raise self.lost(_failure(self.kind, rank, self.world, peer_error)) from peer_error
            raise
        except Exception as e:
            pending, self._pending = self._pending, []
            refs = [ref for _, ref in pending]
            ready, _ = ray.wait(refs, num_returns=len(refs), timeout=5.0) if refs else ([], [])
            for rank, ref in pending:
                if ref in ready:
                    try:
                        ray.get(ref, timeout=1.0)
                    except BaseException as peer_error:
                        raise self.lost(_failure(self.kind, rank, self.world, peer_error)) from e
            raise self.lost(_failure(self.kind, 0, self.world, e)) from e

    def lost(self, why: str) -> PeerFailed:
        """Mark the engine failed and end every peer; the error to raise."""
        self.failed = why
        self.close()
        return PeerFailed(why)

    def close(self) -> None:
        """End every peer and leave this process's gloo world (rank 0's, which ``Peers`` drives)."""
        import torch.distributed as dist

        end_peers(self.actors)
        self.actors = []
        self._pending = []
        if self.owns_group and dist.is_initialized():
            dist.destroy_process_group()
        self.owns_group = False


def start_sharded(kind: str, worker: type, lm: LoadedModel, tp: int, ep: int, *, model_ref: str, config: Any,
                  loader: Loader | None, threads_per_worker: int | None, peer_options: dict[str, Any] | None,
                  timeout_s: float, peer_name: str) -> tuple[Peers, LoadedModel]:
    """Rank 0's side of a ``tp`` x ``ep`` world over the full model ``lm``: the peers
    ``worker(layout, port, model_ref, kernel_config, config, threads, timeout_s, loader)`` for ranks
    ``1..world-1`` (``world = lcm(tp, ep)``), this process joined to their gloo world, and rank 0's
    shard of ``lm``. On failure the peers are ended."""
    import math

    import torch

    from onpolicy.models.checkpoint import shard_model

    from .groups import init_loopback, model_parallel
    from .launch import free_port
    from .layout import check_degrees

    kernel_config = lm.model.ops.config
    check_degrees(lm.config, tp, ep, kernel_config.reduce_chunks)
    world = math.lcm(tp, ep)
    threads = threads_per_worker or torch.get_num_threads()
    port = free_port()
    peers = Peers(kind, start_peers(
        worker, world, lambda rank: (Layout(tp, ep, rank, world), port, model_ref, kernel_config, config, threads,
                                     timeout_s, loader),
        peer_options or {"num_cpus": threads}, peer_name), timeout_s)
    try:
        if world > 1:
            init_loopback(0, world, port, timeout_s)
            peers.owns_group = True
        return peers, shard_model(lm, model_parallel(Layout(tp, ep, 0, world)))
    except BaseException:
        peers.close()
        raise
