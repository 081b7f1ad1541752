"""Peer ranks as Ray actors: the runtime's ``PeerLauncher`` (``ray_peers``) and ``PeerGroup``
(``RayPeers``) for the parallel engines of ``onpolicy.parallel`` and ``onpolicy.trainer``.

``start_peers`` starts ranks ``1..world-1`` as Ray actors (no restarts: a lost rank ends the whole
engine, and the role actor's own restart brings a fresh world); each runs with Ray's environment
(``local_ray.ray_env``) before the worker body. ``end_peers`` kills them; a peer already gone is
ignored. Peers are owned by the process that started them, so Ray also kills them when that process
(the role service's actor) dies: no orphan ranks.

``RayPeers`` drives them from rank 0: ``mirror`` queues a call on every peer (Ray runs one caller's
calls to an actor in submission order, so the ranks meet in the same collectives), ``local`` runs
rank 0's part, ``settle`` waits for the peers' answers, ``share`` puts an argument into the object
store once. A failed or dead peer becomes ``PeerFailed`` naming its rank, after which every peer is
ended — they may be blocked in a collective — and the engine is unusable.
"""

from __future__ import annotations

import contextlib
import secrets
from collections.abc import Callable, Sequence
from typing import Any

import ray

from onpolicy.parallel.peers import PeerFailed, PeerOptions, peer_failure

from .local_ray import ray_env


def _in_ray_env(worker: type) -> type:
    """``worker`` whose construction first sets Ray's environment in the actor's process."""

    class Peer(worker):  # type: ignore[misc, valid-type]
        def __init__(self, *args: Any) -> None:
            ray_env()
            super().__init__(*args)

    Peer.__name__, Peer.__qualname__ = worker.__name__, worker.__qualname__
    return Peer


def start_peers(worker: type, world: int, args: Callable[[int], Sequence[Any]], options: PeerOptions,
                name: str = "") -> list[Any]:
    """Ray actors ``worker(*args(rank))`` for ranks ``1..world-1`` with ``options`` (e.g. ``num_cpus``,
    a placement group bundle; the same for every rank, or a function of the rank), named
    ``{name}-{random}-rank{r}`` when ``name`` is given (a restarted service's new peers get new names
    while the old ones may still be ending)."""
    remote = ray.remote(_in_ray_env(worker))
    tag = f"{name}-{secrets.token_hex(3)}" if name else ""
    return [remote.options(max_restarts=0, **({"name": f"{tag}-rank{rank}"} if tag else {}),
                           **(options(rank) if callable(options) else options))
            .remote(*args(rank)) for rank in range(1, world)]


def end_peers(peers: Sequence[Any]) -> None:
    """Kill every peer actor (those already gone are skipped)."""
    for p in peers:
        with contextlib.suppress(Exception):
            ray.kill(p)


class RayPeers:
    """Ranks ``1..world-1`` of a ``kind`` ("rollout", "trainer") engine as Ray actors, driven by rank 0
    (a ``onpolicy.parallel.peers.PeerGroup``)."""

    def __init__(self, kind: str, actors: list[Any], timeout_s: float) -> None:
        self.kind, self.actors, self.timeout_s = kind, actors, timeout_s
        self.world = len(actors) + 1
        self.failed = ""
        self.owns_group = False
        self._pending: list[tuple[int, Any]] = []

    def __bool__(self) -> bool:
        return bool(self.actors)

    def check(self) -> None:
        if self.failed:
            raise PeerFailed(self.failed)

    def share(self, obj: Any) -> Any:
        return ray.put(obj)

    def mirror(self, method: str, *args: Any) -> None:
        self.check()
        self._pending += [(rank, getattr(p, method).remote(*args)) for rank, p in enumerate(self.actors, start=1)]

    def settle(self) -> list[Any]:
        pending, self._pending = self._pending, []
        out = []
        for rank, ref in pending:
            try:
                out.append(ray.get(ref, timeout=self.timeout_s))
            except BaseException as e:
                raise self.lost(peer_failure(self.kind, rank, self.world, e)) from e
        return out

    def local(self, fn: Callable[[], Any], alike: tuple[type[BaseException], ...] = ()) -> Any:
        """Run rank 0's part of a mirrored call. An ``alike`` error is one every rank raises the same
        way (a refused input): the peers' answers are awaited and it is re-raised. Any other failure:
        a failed peer is the likelier cause (a lost rank breaks the collectives), so name it when one
        has failed within a few seconds; either way end the peers."""
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
                    raise self.lost(peer_failure(self.kind, rank, self.world, peer_error)) from peer_error
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
                        raise self.lost(peer_failure(self.kind, rank, self.world, peer_error)) from e
            raise self.lost(peer_failure(self.kind, 0, self.world, e)) from e

    def lost(self, why: str) -> PeerFailed:
        self.failed = why
        self.close()
        return PeerFailed(why)

    def close(self) -> None:
        import torch.distributed as dist

        end_peers(self.actors)
        self.actors = []
        self._pending = []
        if self.owns_group and dist.is_initialized():
            dist.destroy_process_group()
        self.owns_group = False


class RayPeerLauncher:
    """The runtime's ``PeerLauncher``: ``start_peers`` on the current Ray cluster, driven as
    ``RayPeers``; ``host`` is this process's node IP (as Ray reports it), where the peers meet it."""

    @property
    def host(self) -> str:
        return str(ray.util.get_node_ip_address())

    def __call__(self, kind: str, worker: type, world: int, args: Callable[[int], Sequence[Any]], *,
                 options: PeerOptions, name: str, timeout_s: float) -> RayPeers:
        return RayPeers(kind, start_peers(worker, world, args, options, name), timeout_s)


ray_peers = RayPeerLauncher()
