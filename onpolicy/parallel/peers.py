"""Peer ranks as the domain sees them: what ``MirroredRolloutEngine`` (rollout tp/ep),
``DataParallelEngine`` (trainer dp) and ``ModelParallelEngine`` (trainer tp/ep) share.

Rank 0 lives in the service's own process; ranks ``1..world-1`` run elsewhere, started by a
``PeerLauncher`` the caller passes in (the runtime's is ``onpolicy.services.cluster.peers.ray_peers``:
Ray actors). Each peer loads the model with a ``Loader`` (``peer_model``) and joins rank 0's world at
its ``Rendezvous`` on rank 0's node (``start_peers``, ``groups.join_world``; ``sharded_peer_model``
also keeps the rank's shard).

``PeerGroup`` is how rank 0 drives them: ``mirror`` queues a call on every peer (in the order rank 0
makes them, so the ranks meet in the same collectives), ``local`` runs rank 0's part, ``settle``
waits for the peers' answers, ``share`` makes one copy of a large argument every peer reads. A
failed or dead peer becomes ``PeerFailed`` naming its rank ("trainer rank 1 of 2 failed: …"), after
which every peer is ended and the engine is unusable (``failed`` says why; its service must be
restarted, which brings a fresh world).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol

from onpolicy.kernels import KernelConfig
from onpolicy.models.loading import LoadedModel

from .groups import Rendezvous
from .layout import Layout

Loader = Callable[[str, KernelConfig], LoadedModel]
"""Loads a model reference on an operator set (e.g. ``onpolicy.services.common.model.load_certified``);
must be picklable (it travels to the peers)."""


def load_uncertified(model: str, kernel_config: KernelConfig) -> LoadedModel:
    """The default peer loader: ``model`` on ``kernel_config``'s backend, without the selftest."""
    from onpolicy.kernels import get_backend
    from onpolicy.models.registry import load_model

    return load_model(model, get_backend(kernel_config))


def peer_model(model: str, kernel_config: KernelConfig, threads: int, loader: Loader | None) -> LoadedModel:
    """What every peer rank does first: ``threads`` torch threads, and ``model`` loaded with
    ``loader`` (default ``load_uncertified``)."""
    import torch

    torch.set_num_threads(threads)
    return (loader or load_uncertified)(model, kernel_config)


def sharded_peer_model(layout: Layout, where: Rendezvous, model: str, kernel_config: KernelConfig, threads: int,
                       timeout_s: float, loader: Loader | None) -> LoadedModel:
    """``peer_model``, then join the world of ``layout`` at ``where`` and keep this rank's shard."""
    from onpolicy.parallel.parallelize import shard_model

    from .groups import join_world, model_parallel

    lm = peer_model(model, kernel_config, threads, loader)
    join_world(layout.rank, layout.world, where, timeout_s, lm.model.device.type)
    return shard_model(lm, model_parallel(layout))


class PeerFailed(RuntimeError):
    """A rank of a parallel engine failed or died; the engine has ended every peer."""


def peer_failure(kind: str, rank: int, world: int, e: BaseException) -> str:
    """The message of ``PeerFailed`` for rank ``rank`` of ``world`` failing with ``e``."""
    text = str(e).strip()
    return f"{kind} rank {rank} of {world} failed: {type(e).__name__}: {text.splitlines()[-1] if text else ''}"


class PeerGroup(Protocol):
    """Ranks ``1..world-1`` of a ``kind`` ("rollout", "trainer") engine, as driven by rank 0."""

    kind: str
    world: int
    failed: str
    """Why the engine is unusable (a rank failed), "" while it runs."""
    owns_group: bool
    """Whether rank 0 joined the gloo world for these peers (set once it has): ``close`` leaves it."""

    def __bool__(self) -> bool: ...

    def check(self) -> None:
        """Raise ``PeerFailed`` when a rank has failed before."""

    def share(self, obj: Any) -> Any:
        """``obj`` as one shared copy every peer reads (pass the result to ``mirror``)."""

    def mirror(self, method: str, *args: Any) -> None:
        """Queue ``method(*args)`` on every peer (after the calls queued before)."""

    def settle(self) -> list[Any]:
        """Every queued call's answer (rank order of the calls); a failure becomes ``PeerFailed``."""

    def local(self, fn: Callable[[], Any], alike: tuple[type[BaseException], ...] = ()) -> Any:
        """Run rank 0's part of a mirrored call; an ``alike`` error (one every rank raises the same
        way) is re-raised once the peers have answered, any other failure ends the peers."""

    def lost(self, why: str) -> PeerFailed:
        """Mark the engine failed and end every peer; the error to raise."""

    def close(self) -> None:
        """End every peer and leave this process's gloo world when ``owns_group``."""


PeerOptions = dict[str, Any] | Callable[[int], dict[str, Any]]
"""The runtime's options of a peer rank (e.g. ``num_cpus``, its placement): one for every rank, or
a function of the rank."""


class PeerLauncher(Protocol):
    """Starts ranks ``1..world-1`` of a ``kind`` engine, each ``worker(*args(rank))``, with the
    runtime's ``options``, named after ``name`` when given; answers within ``timeout_s`` or fails.
    ``host`` is the address rank 0 (this process) is reached at by its peers: its node's."""

    host: str

    def __call__(self, kind: str, worker: type, world: int, args: Callable[[int], Sequence[Any]], *,
                 options: PeerOptions, name: str, timeout_s: float) -> PeerGroup: ...


def start_peers(kind: str, worker: type, world: int, args: Callable[[Rendezvous], Callable[[int], Sequence[Any]]], *,
                launch: PeerLauncher, options: PeerOptions, name: str, timeout_s: float, device: str,
                ) -> PeerGroup:
    """Rank 0's side of a world of ``world`` ranks: a rendezvous listening on ``launch.host`` (a port
    free there), the peers ``worker(*args(rendezvous)(rank))`` for ranks ``1..world-1`` started by
    ``launch``, and this process joined to their world (when it has more than one rank). On failure
    the peers are ended."""
    from .groups import join_world, listen

    listener = listen(launch.host)
    where = Rendezvous(launch.host, listener.getsockname()[1])
    try:
        peers = launch(kind, worker, world, args(where), options=options, name=name, timeout_s=timeout_s)
    except BaseException:
        listener.close()
        raise
    try:
        if world > 1:
            join_world(0, world, where, timeout_s, device, listener)
            peers.owns_group = True
        else:
            listener.close()
        return peers
    except BaseException:
        listener.close()
        peers.close()
        raise


def start_sharded(kind: str, worker: type, lm: LoadedModel, tp: int, ep: int, *, launch: PeerLauncher,
                  model_ref: str, config: Any, loader: Loader | None, threads_per_worker: int | None,
                  peer_options: PeerOptions | None, timeout_s: float,
                  peer_name: str) -> tuple[PeerGroup, LoadedModel]:
    """Rank 0's side of a ``tp`` x ``ep`` world over the full model ``lm``: the peers
    ``worker(layout, rendezvous, model_ref, kernel_config, config, threads, timeout_s, loader)`` for
    ranks ``1..world-1`` (``world = lcm(tp, ep)``; ``start_peers``), and rank 0's shard of ``lm``."""
    import math

    import torch

    from onpolicy.parallel.parallelize import shard_model

    from .groups import model_parallel
    from .layout import check_degrees

    kernel_config = lm.model.ops.config
    check_degrees(lm.config, tp, ep, kernel_config.reduce_chunks)
    world = math.lcm(tp, ep)
    threads = threads_per_worker or torch.get_num_threads()
    peers = start_peers(kind, worker, world,
                        lambda where: lambda rank: (Layout(tp, ep, rank, world), where, model_ref, kernel_config,
                                                    config, threads, timeout_s, loader),
                        launch=launch, options=peer_options or {"num_cpus": threads}, name=peer_name,
                        timeout_s=timeout_s, device=lm.model.device.type)
    try:
        return peers, shard_model(lm, model_parallel(Layout(tp, ep, 0, world)))
    except BaseException:
        peers.close()
        raise
