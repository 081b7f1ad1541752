"""Tensor- and expert-parallel invariance, multi-process (gloo over loopback): rollout engine
logprobs at rollout TP ∈ {1, 2} equal the training-path logprobs at trainer TP ∈ {1, 2, 4} (and
EP ∈ {1, 2} for the MoE model) bit for bit; the fast backend's plain all-reduce shows the mismatch;
a backward pass under trainer TP gives finite gradients.

Two launches (worlds of 2 and 4 processes) compute everything; the comparisons run here.
"""

from __future__ import annotations

import pytest
import torch

from onpolicy.kernels import KernelConfig, get_backend
from onpolicy.models.loading import shard_state_dict
from onpolicy.models.registry import load_model
from onpolicy.parallel import ModelParallel
from onpolicy.parallel.check import CheckSpec, Job, JobResult, run_checks
from onpolicy.parallel.groups import GlooShardGroup

KERNELS = KernelConfig(kv_tile=16).to_dict()
PROMPTS = [[1, 2, 3, 4, 5, 6, 7], [40, 41, 42], list(range(100, 120))]
NEW = 6
MODELS = ("tiny-qwen3", "tiny-qwen3-moe")


def _spec(model: str, jobs: list[Job]) -> CheckSpec:
    return CheckSpec(model, KERNELS, jobs, prompts=PROMPTS, max_new_tokens=NEW, seed=3)


def _jobs_world2(moe: bool) -> list[Job]:
    layouts = [(1, 1), (2, 1)] + ([(1, 2), (2, 2)] if moe else [])
    return ([Job("rollout", tp, ep) for tp, ep in layouts] + [Job("trainer", tp, ep) for tp, ep in layouts]
            + [Job("trainer", 1, backend="fast"), Job("trainer", 2, backend="fast"), Job("grad", 1),
               Job("grad", 2, 2 if moe else 1)])


def _jobs_world4(moe: bool) -> list[Job]:
    layouts = [(4, 1)] + ([(4, 2)] if moe else [])
    return ([Job("rollout", 2, 2 if moe else 1)] + [Job("trainer", tp, ep) for tp, ep in layouts]
            + [Job("trainer", 4, backend="fast")] + ([] if moe else [Job("grad", 4)]))


@pytest.fixture(scope="module")
def results() -> dict[str, dict[str, JobResult]]:
    out: dict[str, dict[str, JobResult]] = {}
    grads: dict[str, list[dict[str, torch.Tensor]]] = {}
    for world, jobs in ((2, _jobs_world2), (4, _jobs_world4)):
        specs = [_spec(m, jobs(m.endswith("moe"))) for m in MODELS]
        for model, per_rank in zip(MODELS, run_checks(specs, world=world, timeout_s=240), strict=True):
            rank0 = per_rank[0]
            assert rank0 is not None
            for r in rank0:
                out.setdefault(model, {})[f"w{world}-{r.job.key}"] = r
            for ranked in per_rank:  # every rank's gradients of the grad jobs
                for r in ranked or []:
                    if r.grads:
                        grads.setdefault(f"{model}-{r.job.key}", []).append(r.grads)
    out["grads"] = grads  # type: ignore[assignment]
    return out


def _equal(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


@pytest.mark.parametrize("model", MODELS)
def test_rollout_and_trainer_bitwise_equal_across_degrees(results: dict, model: str) -> None:
    res = results[model]
    rollouts = {k: r for k, r in res.items() if r.job.role == "rollout"}
    trainers = {k: r for k, r in res.items() if r.job.role == "trainer" and r.job.backend is None}
    ref = res["w2-rollout-tp1-ep1-default"]
    assert all(len(t) == NEW for t in ref.token_ids)
    assert {(r.job.tp, r.job.ep) for r in rollouts.values()} >= {(1, 1), (2, 1)}
    assert {r.job.tp for r in trainers.values()} == {1, 2, 4}
    if model.endswith("moe"):
        assert {r.job.ep for r in rollouts.values()} == {1, 2} and {r.job.ep for r in trainers.values()} == {1, 2}
    for key, r in rollouts.items():  # every rollout layout samples the same tokens with the same logprobs
        assert r.token_ids == ref.token_ids, key
        assert _equal(r.logprobs, ref.logprobs), key
    for key, r in trainers.items():  # and every trainer layout recomputes exactly those logprobs
        assert _equal(r.logprobs, ref.logprobs), key


def test_fast_backend_shows_the_mismatch_across_degrees(results: dict) -> None:
    res = results["tiny-qwen3"]
    fast = [res[f"w2-trainer-tp{t}-ep1-fast"].logprobs for t in (1, 2)] + [res["w4-trainer-tp4-ep1-fast"].logprobs]
    assert not _equal(fast[0], fast[1])
    assert not _equal(fast[0], fast[2])


@pytest.mark.parametrize(("model", "key"), [("tiny-qwen3", "grad-tp2-ep1"), ("tiny-qwen3", "grad-tp4-ep1"),
                                            ("tiny-qwen3-moe", "grad-tp2-ep2")])
def test_backward_under_tp_gives_finite_gradients(results: dict, model: str, key: str) -> None:
    grads = results["grads"]
    single = grads[f"{model}-grad-tp1-ep1-default"][0]
    ranks = grads[f"{model}-{key}-default"]
    tp, ep = (int(part[2:]) for part in key.split("-")[1:])
    assert len(ranks) == max(tp, ep)
    cfg = load_model(model, get_backend(KernelConfig.from_dict(dict(KERNELS)))).config
    for rank, g in enumerate(ranks):
        assert g and all(bool(t.isfinite().all()) for t in g.values())
        # the TP=1 gradient, sliced like this rank's parameters, matches it (not bitwise: the backward
        # sums the ranks' partial input gradients, where TP=1 has one GEMM over all columns)
        want = shard_state_dict(single, cfg, _shards(tp, ep, rank))
        assert set(want) == set(g)
        for name, t in g.items():
            assert torch.allclose(t, want[name], rtol=1e-3, atol=1e-6), name
    # replicated parameters get the same full gradient on every rank, bit for bit
    replicated = [n for n in ranks[0] if "norm" in n or "embed_tokens" in n or ".gate." in n]
    assert replicated and all(torch.equal(ranks[0][n], r[n]) for r in ranks[1:] for n in replicated)


def _shards(tp: int, ep: int, rank: int) -> ModelParallel:
    """The groups' shard indices of ``rank`` (no process group needed to slice a state dict)."""
    return ModelParallel(tp=GlooShardGroup(tp, rank % tp), ep=GlooShardGroup(ep, rank % ep))
