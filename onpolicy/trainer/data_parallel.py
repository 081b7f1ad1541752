"""Data-parallel training across Ray workers, bitwise equal to one worker on the same global batch.

``DataParallelEngine`` is a ``TrainerEngine`` that is rank 0 of ``D`` ranks
(``onpolicy.trainer.ranks``): it starts ``D - 1`` peers (``DataParallelWorker``; Ray actors under
the runtime's launcher), each a ``TrainerEngine`` on the same weights, joined by a gloo process
group on loopback (``GlooExchange``). A train step shares the global batch once
(``PeerGroup.share``: Ray's object store under the runtime's launcher); every rank reads it, runs
forward and backward only on the canonical units it owns and folds them, and the ``D`` subtree sums
are all-gathered and folded in the canonical tree of ``onpolicy.trainer.reduction`` — so every rank
applies the update one worker would have applied, and two runs with the same seeds end with the same
weights. After each step rank 0 checks that every peer holds weights with its sha256
(``ReplicaDivergence`` otherwise).

Everything else is rank 0's: logprobs, weight export and checkpoints come from its weights and
optimizer state (identical on every rank); ``restore`` restores every rank. So the trainer service
serves a ``DataParallelEngine`` exactly like a ``TrainerEngine`` (job spec ``parallel.trainer.dp``).

Every rank should run with the same torch thread count (peers get ``threads_per_worker``, default:
rank 0's count): per-unit kernels are then the same computation on every rank and in one worker.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from onpolicy.kernels import KernelConfig
from onpolicy.models.loading import LoadedModel
from onpolicy.parallel.groups import Rendezvous, join_world
from onpolicy.parallel.peers import Loader, PeerLauncher, PeerOptions, peer_model, start_peers

from .config import TrainerConfig
from .engine import TrainerEngine
from .ranks import RankWorker, RankZeroEngine
from .reduction import Grads, check_degree


class GlooExchange:
    """``GradientExchange`` over the process's default ``torch.distributed`` group (joined by rank 0
    in ``start_peers``, by a peer here: ``onpolicy.parallel.groups.join_world``, a timeout on every
    collective)."""

    def __init__(self, rank: int, size: int, where: Rendezvous | None = None, timeout_s: float = 300.0,
                 device: str = "cpu") -> None:
        if where is not None:
            join_world(rank, size, where, timeout_s, device)
        self.rank, self.size = rank, size

    def all_gather_grads(self, grads: Grads | None, like: Sequence[Tensor]) -> list[Grads | None]:
        """One flat fp32 buffer per rank: the gradients back to back, then one presence flag per parameter."""
        sizes = [p.numel() for p in like]
        total = sum(sizes)
        flat = torch.zeros(total + len(sizes), dtype=torch.float32)
        offset = 0
        for i, (n, g) in enumerate(zip(sizes, grads or [None] * len(sizes), strict=True)):
            if g is not None:
                flat[offset:offset + n] = g.reshape(-1)
                flat[total + i] = 1.0
            offset += n
        gathered = [torch.empty_like(flat) for _ in range(self.size)]
        dist.all_gather(gathered, flat)
        out: list[Grads | None] = []
        for buf in gathered:
            parts = buf[:total].split(sizes)
            out.append([part.view(p.shape) if buf[total + i] else None
                        for i, (part, p) in enumerate(zip(parts, like, strict=True))])
        return out

    def all_gather_object(self, obj: Any) -> list[Any]:
        out: list[Any] = [None] * self.size
        dist.all_gather_object(out, obj)
        return out


class DataParallelWorker(RankWorker):
    """Body of a peer rank: a ``TrainerEngine`` on ``model`` joined to its peers by gloo."""

    def __init__(self, rank: int, size: int, where: Rendezvous, model: str, kernel_config: KernelConfig,
                 trainer_config: TrainerConfig | None, threads: int, timeout_s: float, loader: Loader | None) -> None:
        lm = peer_model(model, kernel_config, threads, loader)
        self.exchange = GlooExchange(rank, size, where, timeout_s, lm.model.device.type)
        self.engine = TrainerEngine(lm, trainer_config, self.exchange)


class DataParallelEngine(RankZeroEngine):
    """Rank 0 of ``degree`` data-parallel ranks (peers started by ``launch`` with ``peer_options``,
    e.g. ``{"num_cpus": 1}``; the runtime's launcher is ``onpolicy.services.cluster.peers.ray_peers``).
    Peers load ``model_ref`` (the reference ``lm`` was loaded from) with ``loader`` (a picklable
    function; default: no certification), named after ``peer_name`` when given. ``close()`` (or
    ``with``) ends the peers; a failed collective or peer closes them too (the engine is then
    unusable)."""

    kind = "data-parallel"

    def __init__(self, lm: LoadedModel, config: TrainerConfig | None = None, *, degree: int,
                 launch: PeerLauncher, model_ref: str,
                 loader: Loader | None = None, threads_per_worker: int | None = None,
                 peer_options: PeerOptions | None = None, timeout_s: float = 300.0, peer_name: str = "") -> None:
        check_degree(degree)
        threads = threads_per_worker or torch.get_num_threads()
        self.peers = start_peers(
            "trainer", DataParallelWorker, degree,
            lambda where: lambda rank: (rank, degree, where, model_ref, lm.model.ops.config, config, threads,
                                        timeout_s, loader),
            launch=launch, options=peer_options or {"num_cpus": threads}, name=peer_name, timeout_s=timeout_s,
            device=lm.model.device.type)
        try:
            exchange = GlooExchange(0, degree) if degree > 1 else None  # rank 0 joined in start_peers
            super().__init__(lm, config, exchange)
            self._check_peers(self._ask("replica_sha256"), "at start")
        except BaseException:
            self.close()
            raise
