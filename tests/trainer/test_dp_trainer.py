"""Data-parallel training over Ray workers (gloo on loopback): 2 ranks give bitwise the weights and the
statistics of one worker on the same global batch, two runs with the same seeds agree, and a checkpoint
restored on rank 0 restores every rank."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import torch

from onpolicy.kernels.selftest import num_threads
from onpolicy.models.loading import LoadedModel
from onpolicy.services.cluster.peers import ray_peers
from onpolicy.trainer.checkpoint import load_checkpoint
from onpolicy.trainer.config import LossConfig, OptimizerConfig, StepStats, TrainerConfig, TrainSample
from onpolicy.trainer.data_parallel import DataParallelEngine

MODEL = "tiny-qwen3"
# pack_tokens 24: minibatches of 5, 2 and 3 canonical units, so the two ranks own uneven subtrees
TRAINER = TrainerConfig(pack_tokens=24, seed=7)
OPT = OptimizerConfig(lr=1e-3, weight_decay=0.01, grad_clip=1.0)
# step 1: one minibatch, token-mean; step 2: two minibatches, seq-mean, a KL penalty, 2 epochs
LOSSES = (LossConfig(kl_coef=0.05), LossConfig(minibatches=2, epochs=2, loss_agg="seq-mean", kl_coef=0.05))


def _train(degree: int, lm: LoadedModel, batches: list[list[TrainSample]], checkpoints: Path | None = None,
           ) -> tuple[list[dict[str, torch.Tensor]], list[StepStats]]:
    """Every rank's weights after one step per batch. With ``checkpoints``: also save after the first
    step, restore it after the last, redo the last step and check every rank lands on the same bits."""
    with num_threads(1), DataParallelEngine(lm, TRAINER, degree=degree, launch=ray_peers, model_ref=MODEL,
                                                threads_per_worker=1) as dp:
        stats = []
        for k, (b, loss) in enumerate(zip(batches, LOSSES, strict=True)):
            if k == 1 and checkpoints is not None:
                saved = dp.save_checkpoint(checkpoints)
            stats.append(dp.train_step(b, loss, OPT))
        weights = [dp.state_dict_for_rollout(), *dp.peer_state_dicts()]
        if checkpoints is not None:
            dp.restore(load_checkpoint(saved))
            assert dp.step == 1
            dp.train_step(batches[-1], LOSSES[-1], OPT)
            again = [dp.state_dict_for_rollout(), *dp.peer_state_dicts()]
            assert all(_equal(a, b) for a, b in zip(again, weights, strict=True))
        return weights, stats


def _equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _timeless(st: StepStats) -> StepStats:
    return replace(st, seconds=0.0, tokens_per_second=0.0)


def test_two_ranks_equal_one_worker_and_repeat(ray_cluster: None, batches: list[list[TrainSample]],
                                               load_tiny: Callable[..., LoadedModel], tmp_path: Path) -> None:
    dp2, stats2 = _train(2, load_tiny(MODEL, fresh=True), batches, tmp_path)
    assert len(dp2) == 2 and _equal(dp2[0], dp2[1])  # both ranks applied the identical update
    dp1, stats1 = _train(1, load_tiny(MODEL, fresh=True), batches)
    assert _equal(dp2[0], dp1[0])  # ... the one a single worker applies to the same global batch
    assert [_timeless(s) for s in stats2] == [_timeless(s) for s in stats1]
    assert not _equal(dp1[0], load_tiny(MODEL).model.state_dict())  # the weights did move
    again, _ = _train(2, load_tiny(MODEL, fresh=True), batches)  # same seeds, same batches: same weights
    assert _equal(again[0], dp2[0]) and _equal(again[1], dp2[1])


def test_fast_kernels_are_data_parallel_invariant_too(ray_cluster: None, batches: list[list[TrainSample]],
                                                      load_tiny: Callable[..., LoadedModel]) -> None:
    """The fast backend is not batch-invariant, but DP never changes a unit's batch: each rank runs the
    same units (same shapes, same thread count) one worker runs, and the fold is the same tree. (What the
    fast mode does change is the rollout-vs-trainer logprobs: ``old_logprob_max_abs_diff`` > 0 here.)"""
    dp2, _ = _train(2, load_tiny(MODEL, backend="fast", fresh=True), batches)
    dp1, _ = _train(1, load_tiny(MODEL, backend="fast", fresh=True), batches)
    assert _equal(dp2[0], dp2[1]) and _equal(dp2[0], dp1[0])
