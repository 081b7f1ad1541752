"""Data-parallel training across Ray workers, bitwise equal to one worker on the same global batch.

``DataParallelEngine`` is a ``TrainerEngine`` that is rank 0 of ``D`` ranks: it starts ``D - 1`` peer
Ray actors (``DataParallelWorker``), each a ``TrainerEngine`` on the same weights, joined by a gloo
process group on loopback (``GlooExchange``). A train step puts the global batch into Ray's object
store once; every rank reads it, runs forward and backward only on the canonical units it owns and
folds them, and the ``D`` subtree sums are all-gathered and folded in the canonical tree of
``onpolicy.trainer.reduction`` — so every rank applies the update one worker would have applied, and
two runs with the same seeds end with the same weights. After each step rank 0 checks that every peer
holds weights with its sha256 (``ReplicaDivergence`` otherwise).

Everything else is rank 0's: logprobs, weight export and checkpoints come from its weights and
optimizer state (identical on every rank); ``restore`` restores every rank. So the trainer service
serves a ``DataParallelEngine`` exactly like a ``TrainerEngine`` (job spec ``parallel.trainer.dp``).

Every rank should run with the same torch thread count (peers get ``threads_per_worker``, default:
rank 0's count): per-unit kernels are then the same computation on every rank and in one worker.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from onpolicy.kernels import KernelConfig
from onpolicy.models.checkpoint import LoadedModel
from onpolicy.parallel.groups import init_loopback
from onpolicy.parallel.launch import free_port
from onpolicy.parallel.peers import Loader, end_peers, load_uncertified, start_peers

from .checkpoint import CheckpointState
from .config import LossConfig, OptimizerConfig, StepStats, TrainerConfig, TrainSample
from .engine import TrainerEngine
from .reduction import Grads, check_degree


class ReplicaDivergence(RuntimeError):
    """Data-parallel ranks ended a step with different weights (a broken invariant, never expected)."""


class GlooExchange:
    """``GradientExchange`` over the process's default ``torch.distributed`` group: gloo on loopback
    (``onpolicy.parallel.groups.init_loopback``, a timeout on every collective)."""

    def __init__(self, rank: int, size: int, port: int, timeout_s: float = 300.0) -> None:
        init_loopback(rank, size, port, timeout_s)
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

    def close(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()


class DataParallelWorker:
    """Body of a peer rank's Ray actor: a ``TrainerEngine`` on ``model`` joined to its peers by gloo."""

    def __init__(self, rank: int, size: int, port: int, model: str, kernel_config: KernelConfig,
                 trainer_config: TrainerConfig | None, threads: int, timeout_s: float, loader: Loader | None) -> None:
        from onpolicy.services.cluster.local_ray import ray_env

        ray_env()
        torch.set_num_threads(threads)
        lm = (loader or load_uncertified)(model, kernel_config)
        self.exchange = GlooExchange(rank, size, port, timeout_s)
        self.engine = TrainerEngine(lm, trainer_config, self.exchange)

    def train_step(self, samples: list[TrainSample], loss: LossConfig, opt: OptimizerConfig,
                   recompute_old: bool) -> str:
        """Run this rank's share of the step; the sha256 of the weights it produced."""
        self.engine.train_step(samples, loss, opt, recompute_old)
        return self.engine.weights_sha256

    def restore(self, state: CheckpointState) -> str:
        self.engine.restore(state)
        return self.engine.weights_sha256

    def weights_sha256(self) -> str:
        return self.engine.weights_sha256

    def state_dict(self) -> dict[str, Tensor]:
        return self.engine.state_dict_for_rollout()


class DataParallelEngine(TrainerEngine):
    """Rank 0 of ``degree`` data-parallel ranks (peers: Ray actors on the current Ray cluster, started
    with ``peer_options``, e.g. ``{"num_cpus": 1}``; start a local cluster with
    ``onpolicy.services.cluster.local_ray.init_ray``). Peers load ``model_ref`` (the reference ``lm``
    was loaded from) with ``loader`` (a picklable function; default: no certification). ``close()``
    (or ``with``) ends the peers; a failed collective or peer closes them too (the engine is then
    unusable)."""

    def __init__(self, lm: LoadedModel, config: TrainerConfig | None = None, *, degree: int, model_ref: str,
                 loader: Loader | None = None, threads_per_worker: int | None = None,
                 peer_options: dict[str, Any] | None = None, timeout_s: float = 300.0) -> None:
        check_degree(degree)
        self.timeout_s = timeout_s
        threads = threads_per_worker or torch.get_num_threads()
        port = free_port()
        self.peers = start_peers(
            DataParallelWorker, degree,
            lambda rank: (rank, degree, port, model_ref, lm.model.ops.config, config, threads, timeout_s, loader),
            peer_options or {"num_cpus": threads})
        try:
            exchange = GlooExchange(0, degree, port, timeout_s) if degree > 1 else None
            super().__init__(lm, config, exchange)
            self._check_peers(self._get([p.weights_sha256.remote() for p in self.peers]), "at start")
        except BaseException:
            self.close()
            raise

    def _get(self, refs: list[Any]) -> list[Any]:
        import ray

        try:
            return list(ray.get(refs, timeout=self.timeout_s))
        except BaseException:
            self.close()  # a failed rank leaves its peers blocked in a collective: end them all
            raise

    def _check_peers(self, shas: list[str], when: str) -> None:
        if any(sha != self.weights_sha256 for sha in shas):
            raise ReplicaDivergence(f"data-parallel ranks hold different weights {when}: rank 0 "
                                    f"{self.weights_sha256[:12]}, " + ", ".join(
                                        f"rank {r}: {sha[:12]}" for r, sha in enumerate(shas, start=1)))

    def train_step(self, samples: Sequence[TrainSample], loss: LossConfig, opt: OptimizerConfig,
                   recompute_old: bool = False) -> StepStats:
        """``TrainerEngine.train_step`` on the global batch ``samples``, run by every rank at once."""
        import ray

        if not self.peers:
            return super().train_step(samples, loss, opt, recompute_old)
        batch = ray.put(list(samples))  # one copy in the object store, read by every peer
        pending = [p.train_step.remote(batch, loss, opt, recompute_old) for p in self.peers]
        try:
            stats = super().train_step(samples, loss, opt, recompute_old)
        except (ValueError, FloatingPointError):
            # every rank refuses the same batch (or diverges) alike: the peers raise the same error
            with contextlib.suppress(Exception):
                ray.get(pending, timeout=self.timeout_s)
            raise
        except BaseException:
            self.close()
            raise
        self._check_peers(self._get(pending), f"after step {self.step}")
        return stats

    def restore(self, state: CheckpointState) -> None:
        super().restore(state)
        self._check_peers(self._get([p.restore.remote(state) for p in self.peers]), f"restoring step {self.step}")

    def peer_state_dicts(self) -> list[dict[str, Tensor]]:
        """Every peer's weights (ranks 1..D-1, in order)."""
        return self._get([p.state_dict.remote() for p in self.peers])

    def close(self) -> None:
        end_peers(getattr(self, "peers", []))
        self.peers = []
        exchange = getattr(self, "exchange", None)
        if isinstance(exchange, GlooExchange):
            exchange.close()

    def __enter__(self) -> DataParallelEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
