"""The tensor/expert-parallel trainer (``ModelParallelEngine``: rank 0 here, peers as Ray actors, gloo on
loopback) on tiny Qwen3 and Qwen3-MoE: its logprobs are bitwise those of an unsharded trainer on the
same weights, before and after updates; its updates match TP=1 up to rounding; its checkpoints hold
the unsharded state, resume bitwise at the same degrees and restore at any other."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from onpolicy.kernels.selftest import num_threads
from onpolicy.models.loading import LoadedModel
from onpolicy.services.cluster.peers import ray_peers
from onpolicy.trainer.checkpoint import CheckpointError, load_checkpoint
from onpolicy.trainer.config import LossConfig, OptimizerConfig, TrainerConfig, TrainSample
from onpolicy.trainer.engine import TrainerEngine
from onpolicy.trainer.model_parallel import ModelParallelEngine

TRAINER = TrainerConfig(pack_tokens=24, seed=7)
OPT = OptimizerConfig(lr=1e-3, weight_decay=0.01, grad_clip=1.0)
LOSSES = (LossConfig(kl_coef=0.05), LossConfig(minibatches=2, loss_agg="seq-mean", kl_coef=0.05))


def _equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _logprobs(engine: TrainerEngine, batch: list[TrainSample]) -> list[torch.Tensor]:
    return engine.compute_logprobs([s.scored for s in batch])


def _on_weights(lm: LoadedModel, state: dict[str, torch.Tensor]) -> TrainerEngine:
    """An unsharded trainer on ``state`` (what a rollout receives from the trainer)."""
    one = TrainerEngine(lm, TRAINER)
    with torch.no_grad():
        for name, p in one.model.named_parameters():
            p.copy_(state[name])
    return one


@pytest.mark.parametrize(("model", "tp", "ep"), [("tiny-qwen3", 2, 1), ("tiny-qwen3", 4, 1), ("tiny-qwen3-moe", 2, 2)])
def test_sharded_trainer_matches_unsharded(ray_cluster: None, model: str, tp: int, ep: int, tmp_path: Path,
                                           rollout_batches: Callable[[str], list[list[TrainSample]]],
                                           load_tiny: Callable[..., LoadedModel]) -> None:
    batches = rollout_batches(model)
    with num_threads(1), ModelParallelEngine(load_tiny(model, fresh=True), TRAINER, tp=tp, ep=ep, launch=ray_peers,
                                             model_ref=model, threads_per_worker=1) as mp:
        one = TrainerEngine(load_tiny(model, fresh=True), TRAINER)
        assert mp.weights_sha256 == one.weights_sha256  # names the unsharded weights
        for a, b in zip(_logprobs(mp, batches[0]), _logprobs(one, batches[0]), strict=True):
            assert torch.equal(a, b)

        s_mp, s_one = mp.train_step(batches[0], LOSSES[0], OPT), one.train_step(batches[0], LOSSES[0], OPT)
        assert s_mp.old_logprob_max_abs_diff == 0.0  # rollout logprobs == sharded training path, bitwise
        assert s_mp.grad_norm == pytest.approx(s_one.grad_norm, rel=1e-4)
        full = mp.state_dict_for_rollout()
        assert full.keys() == one.model.state_dict().keys()
        # TP=1's update up to rounding (see model_parallel); AdamW's normalised step amplifies it on
        # near-zero gradients, so a few elements may move by up to 2 lr
        off = [(full[k] - v).abs() for k, v in one.model.state_dict().items()]
        assert max(float(d.max()) for d in off) <= 2 * OPT.lr
        assert sum(int((d > 1e-6).sum()) for d in off) <= 0.01 * sum(d.numel() for d in off)
        # the contract after an update: any unsharded engine on the exported weights scores bitwise alike
        on_full = _on_weights(load_tiny(model, fresh=True), full)
        for a, b in zip(_logprobs(mp, batches[1]), _logprobs(on_full, batches[1]), strict=True):
            assert torch.equal(a, b)

        saved = mp.save_checkpoint(tmp_path / "ckpt")
        # step 2 recomputes the old logprobs (a mirrored forward inside the mirrored step)
        s2 = mp.train_step(batches[1], LOSSES[1], OPT, recompute_old=True)
        assert s2.recompute_seconds > 0 and s2.old_logprob_max_abs_diff > 0  # the weights moved since the rollout
        after = mp.state_dict_for_rollout()
        mp.restore(load_checkpoint(saved))
        assert mp.step == 1 and _equal(mp.state_dict_for_rollout(), full)
        mp.train_step(batches[1], LOSSES[1], OPT, recompute_old=True)
        assert _equal(mp.state_dict_for_rollout(), after)  # resumed bitwise: moments and reference restored

    # the checkpoint is unsharded: an unsharded trainer restores it and writes back the same state
    back = TrainerEngine(load_tiny(model, fresh=True), TRAINER)
    back.restore(load_checkpoint(saved))
    assert _equal(back.model.state_dict(), full)
    again = load_checkpoint(back.save_checkpoint(tmp_path / "again"))
    first = load_checkpoint(saved)
    assert first.optimizer is not None and again.optimizer is not None
    assert first.optimizer["state"].keys() == again.optimizer["state"].keys()
    for i, st in first.optimizer["state"].items():
        assert all(torch.equal(st[k], again.optimizer["state"][i][k]) for k in st)
    assert first.reference is not None and again.reference is not None and _equal(first.reference, again.reference)


def test_refused_calls_keep_the_world(ray_cluster: None, tmp_path: Path,
                                      rollout_batches: Callable[[str], list[list[TrainSample]]],
                                      load_tiny: Callable[..., LoadedModel]) -> None:
    """A batch every rank refuses, a checkpoint of another model: clear errors, and the ranks still
    train together afterwards (only a lost rank ends the world)."""
    batch = rollout_batches("tiny-qwen3")[0]
    other = TrainerEngine(load_tiny("tiny-qwen3-moe", fresh=True), TRAINER)
    foreign = load_checkpoint(other.save_checkpoint(tmp_path / "moe"))
    with num_threads(1), ModelParallelEngine(load_tiny("tiny-qwen3", fresh=True), TRAINER, tp=2, launch=ray_peers,
                                             model_ref="tiny-qwen3", threads_per_worker=1) as mp:
        with pytest.raises(ValueError, match="minibatches"):
            mp.train_step(batch, LossConfig(minibatches=len(batch) + 1), OPT)
        with pytest.raises(CheckpointError, match="do not match model"):
            mp.restore(foreign)
        assert mp.failed == "" and mp.step == 0
        assert mp.train_step(batch, LOSSES[0], OPT).step == 1
