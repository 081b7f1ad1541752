"""Data-parallel training across Ray workers, bitwise equal to one worker on the same global batch.

``DataParallelTrainer`` (the coordinator, in the caller's process) starts ``D`` Ray actors
(``DataParallelWorker``), each holding a ``TrainerEngine`` on the same weights and one rank of a gloo
process group on loopback (``GlooExchange``). A train step puts the global batch into Ray's object store
once; every rank reads it, computes forward and backward only on the units it owns and folds them, and
the ``D`` subtree sums are all-gathered and folded in the canonical tree of
``onpolicy.trainer.reduction`` — so every rank applies the update one worker would have applied, and
two runs with the same seeds end with the same weights. After each step the coordinator checks that
every rank holds weights with the same sha256 (``ReplicaDivergence`` otherwise).

Ranks run with a fixed torch thread count each (``threads_per_worker``, default 1): per-unit kernels
are then the same computation on every rank and in a single-worker run with that count.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import socket
import time
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from onpolicy.kernels import KernelConfig

from .config import LossConfig, OptimizerConfig, StepStats, TrainerConfig, TrainSample
from .reduction import Grads, check_degree


class ReplicaDivergence(RuntimeError):
    """Data-parallel ranks ended a step with different weights (a broken invariant, never expected)."""


def free_loopback_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class GlooExchange:
    """``GradientExchange`` over the process's default ``torch.distributed`` group: gloo, rendezvous at
    ``tcp://127.0.0.1:port``, and the gloo device on the loopback interface (``GLOO_SOCKET_IFNAME``)."""

    def __init__(self, rank: int, size: int, port: int, timeout_s: float = 300.0) -> None:
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
        if dist.is_initialized():
            raise RuntimeError("this process already has a torch.distributed group; a data-parallel rank needs "
                               "its own process (a DataParallelWorker actor)")
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=size,
                                timeout=datetime.timedelta(seconds=timeout_s))
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
    """Body of one rank's Ray actor: a ``TrainerEngine`` on ``model`` joined to its peers by gloo."""

    def __init__(self, rank: int, size: int, port: int, model: str, kernel_config: KernelConfig,
                 trainer_config: TrainerConfig, threads: int, timeout_s: float) -> None:
        from onpolicy.services.cluster.local_ray import ray_env

        ray_env()
        torch.set_num_threads(threads)
        from onpolicy.kernels import get_backend
        from onpolicy.models.registry import load_model

        from .engine import TrainerEngine

        lm = load_model(model, get_backend(kernel_config))
        self.exchange = GlooExchange(rank, size, port, timeout_s)
        self.engine = TrainerEngine(lm, trainer_config, self.exchange)

    def train_step(self, samples: list[TrainSample], loss: LossConfig, opt: OptimizerConfig,
                   recompute_old: bool) -> tuple[StepStats, str]:
        """The step's statistics and the sha256 of the weights it produced."""
        stats = self.engine.train_step(samples, loss, opt, recompute_old)
        return stats, self.engine.weights_sha256

    def weights_sha256(self) -> str:
        return self.engine.weights_sha256

    def state_dict(self) -> dict[str, Tensor]:
        return self.engine.state_dict_for_rollout()

    def close(self) -> None:
        self.exchange.close()


class DataParallelTrainer:
    """Coordinator of ``degree`` data-parallel ranks (Ray actors on the current Ray cluster; start one
    with ``onpolicy.services.cluster.local_ray.init_ray``). Not thread-safe: callers serialise access.
    ``close()`` (or ``with``) kills the actors."""

    def __init__(self, model: str, kernel_config: KernelConfig, degree: int,
                 trainer_config: TrainerConfig | None = None, *, threads_per_worker: int = 1,
                 timeout_s: float = 300.0) -> None:
        import ray

        check_degree(degree)
        if threads_per_worker < 1:
            raise ValueError(f"threads_per_worker must be >= 1, got {threads_per_worker}")
        self.degree, self.timeout_s = degree, timeout_s
        self.step = 0
        port = free_loopback_port()
        remote = ray.remote(DataParallelWorker)
        self.workers = [
            remote.options(num_cpus=threads_per_worker, max_restarts=0).remote(
                rank, degree, port, model, kernel_config, trainer_config or TrainerConfig(), threads_per_worker,
                timeout_s)
            for rank in range(degree)]
        try:
            self.weights_sha256 = self._same(ray.get([w.weights_sha256.remote() for w in self.workers],
                                                     timeout=self.timeout_s))
        except BaseException:
            self.close()
            raise

    def _same(self, shas: list[str]) -> str:
        """The one weights sha256 every rank reports."""
        if len(set(shas)) != 1:
            raise ReplicaDivergence(f"data-parallel ranks hold different weights after step {self.step}: "
                                    + ", ".join(f"rank {r}: {s[:12]}" for r, s in enumerate(shas)))
        return str(shas[0])

    def train_step(self, samples: Sequence[TrainSample], loss: LossConfig, opt: OptimizerConfig,
                   recompute_old: bool = False) -> StepStats:
        """One step of ``TrainerEngine.train_step`` on the global batch ``samples`` across all ranks.
        Returns rank 0's statistics (every rank computes the same) with the coordinator's wall time."""
        import ray

        t0 = time.perf_counter()
        batch = ray.put(list(samples))  # one copy in the object store, read by every rank
        results = [w.train_step.remote(batch, loss, opt, recompute_old) for w in self.workers]
        try:
            out = ray.get(results, timeout=self.timeout_s)
        except BaseException:
            self.close()  # a failed rank leaves its peers blocked in a collective: end them all
            raise
        self.step = out[0][0].step
        self.weights_sha256 = self._same([sha for _, sha in out])
        seconds = time.perf_counter() - t0
        stats = out[0][0]
        return replace(stats, seconds=seconds, tokens_per_second=stats.tokens / seconds if seconds > 0 else 0.0)

    def state_dicts(self) -> list[dict[str, Tensor]]:
        """Every rank's weights (in rank order)."""
        import ray

        return list(ray.get([w.state_dict.remote() for w in self.workers], timeout=self.timeout_s))

    def close(self) -> None:
        import ray

        for w in self.workers:
            with contextlib.suppress(Exception):  # already gone
                ray.kill(w)
        self.workers = []

    def __enter__(self) -> DataParallelTrainer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
