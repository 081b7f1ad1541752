"""The multi-process consistency run: rollout engines and training-path forwards at independent
TP/EP degrees in one loopback world, every rank running the same work (SPMD).

The parent builds a ``CheckSpec`` (model, kernel config, prompts, sampling params, and the list of
``Job`` s) and calls ``run_check``; each worker loads the full checkpoint, builds the sharded model
of each job's layout and runs it: a ``rollout`` job generates the prompts with the rollout engine
(every rank runs the same scheduler on the same requests, the collectives run inside the model
forward), a ``trainer`` job scores sequences on the training path (``sequence_logprobs``), a
``grad`` job also runs a backward pass and returns this rank's gradients. Rank 0's results come
back for the parent to compare bit for bit; ``grad`` jobs return every rank's gradients.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

import torch
from torch import Tensor

from onpolicy.kernels import KernelConfig, get_backend

from .launch import run_workers
from .layout import Layout

Role = Literal["rollout", "trainer", "grad"]


@dataclass(frozen=True)
class Job:
    role: Role
    tp: int = 1
    ep: int = 1
    backend: str | None = None
    """Kernel backend for this job (default: the spec's)."""

    @property
    def key(self) -> str:
        return f"{self.role}-tp{self.tp}-ep{self.ep}-{self.backend or 'default'}"


@dataclass(frozen=True)
class Sequences:
    """Prompts + continuations to score (token ids) at their logprob temperature."""

    prompt_ids: list[tuple[int, ...]]
    token_ids: list[tuple[int, ...]]
    temperatures: list[float]


@dataclass
class CheckSpec:
    model: str
    kernels: dict[str, object]
    jobs: list[Job]
    prompts: list[list[int]] = field(default_factory=list)
    max_new_tokens: int = 8
    seed: int = 0
    sequences: Sequences | None = None
    """What trainer/grad jobs score; default: the completions of the first rollout job."""
    pack_tokens: int = 4096


@dataclass
class JobResult:
    job: Job
    token_ids: list[tuple[int, ...]] = field(default_factory=list)
    """Rollout jobs: the generated tokens of every prompt."""
    logprobs: list[Tensor] = field(default_factory=list)
    """fp32 logprobs per sequence (rollout: as sampled; trainer/grad: recomputed)."""
    grads: dict[str, Tensor] = field(default_factory=dict)
    """Grad jobs: this rank's parameter gradients (sharded parameters hold this rank's shard)."""


def world_for(jobs: list[Job]) -> int:
    """The smallest world every job's degrees divide (their least common multiple)."""
    import math

    world = 1
    for j in jobs:
        world = math.lcm(world, j.tp, j.ep)
    return world


def _worker(rank: int, world: int, specs: list[CheckSpec]) -> list[list[JobResult] | None]:
    return [_run_spec(rank, world, spec) for spec in specs]


def _run_spec(rank: int, world: int, spec: CheckSpec) -> list[JobResult] | None:
    from onpolicy.models.registry import load_model
    from onpolicy.parallel.parallelize import shard_model
    from onpolicy.rollout import EngineConfig, RolloutEngine, SamplingParams
    from onpolicy.trainer.forward import ScoredSequence, sequence_logprobs

    from .groups import model_parallel

    base = KernelConfig.from_dict(dict(spec.kernels))
    full: dict[str, object] = {}
    results: list[JobResult] = []
    seqs = spec.sequences
    for job in spec.jobs:
        config = base.with_(backend=job.backend) if job.backend else base
        if config.backend not in full:
            full[config.backend] = load_model(spec.model, get_backend(config))
        lm = shard_model(full[config.backend], model_parallel(Layout(job.tp, job.ep, rank, world)))  # type: ignore[arg-type]
        res = JobResult(job)
        if job.role == "rollout":
            params = SamplingParams(temperature=1.0, max_new_tokens=spec.max_new_tokens, seed=spec.seed)
            need = sum(len(p) + spec.max_new_tokens + 2 * config.kv_tile for p in spec.prompts)
            comps = RolloutEngine(lm, EngineConfig(kv_cache_tokens=need)).generate(spec.prompts, params)
            res.token_ids = [c.token_ids for c in comps]
            res.logprobs = [torch.tensor(c.logprobs, dtype=torch.float32) for c in comps]
            if seqs is None:
                seqs = Sequences([c.prompt_ids for c in comps], res.token_ids, [c.temperature for c in comps])
        else:
            if seqs is None:
                raise ValueError(f"job {job.key} has nothing to score: give sequences or a rollout job first")
            scored = [ScoredSequence(tuple(p), tuple(t), temp)
                      for p, t, temp in zip(seqs.prompt_ids, seqs.token_ids, seqs.temperatures, strict=True)]
            if job.role == "trainer":
                with torch.no_grad():
                    res.logprobs = sequence_logprobs(lm.model, scored, pack_tokens=spec.pack_tokens)
            else:
                lm.model.requires_grad_(True)
                lps = sequence_logprobs(lm.model, scored, pack_tokens=spec.pack_tokens)
                torch.cat(lps).mean().neg().backward()
                res.logprobs = [lp.detach() for lp in lps]
                res.grads = {n: p.grad.clone() for n, p in lm.model.named_parameters() if p.grad is not None}
        results.append(res)
    if rank == 0:
        return results
    return [JobResult(r.job, grads=r.grads) for r in results] if any(r.grads for r in results) else None


def run_checks(specs: list[CheckSpec], *, world: int | None = None, timeout_s: float = 300.0,
               ) -> list[list[list[JobResult] | None]]:
    """Run every spec in one launch of ``world`` local processes (default: the smallest world all
    jobs fit); returns, per spec, the rank-ordered results (``None`` for ranks with nothing to return)."""
    world = world or world_for([j for s in specs for j in s.jobs])
    per_rank = run_workers(_worker, world, specs, timeout_s=timeout_s)
    return [[per_rank[r][i] for r in range(world)] for i in range(len(specs))]
