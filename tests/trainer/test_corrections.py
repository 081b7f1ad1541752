"""Rollout correction (TIS / MIS, token / sequence): the weights against hand-computed cases, the
exact no-op with logdiff 0 on a real trainer engine with consistent kernels (the bits of the loss,
the gradients and the weights after a step), a negative control with a perturbed rollout logprob,
and the metrics: TrainStep response fields and the trainer role's Prometheus histogram."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import replace

import pytest
import torch
from prometheus_client import generate_latest

from onpolicy.models.loading import LoadedModel
from onpolicy.rollout import EngineConfig, RolloutEngine, SamplingParams
from onpolicy.services.api import trainer_pb2
from onpolicy.services.common.role_metrics import TrainerMetrics
from onpolicy.services.trainer.servicer import TrainerServicer
from onpolicy.trainer.config import LossConfig, OptimizerConfig, TrainSample
from onpolicy.trainer.correction import RATIO_BUCKETS, apply_correction, correction_weights, histogram, raw_weights
from onpolicy.trainer.engine import TrainerEngine
from onpolicy.trainer.forward import pack_logprobs
from onpolicy.trainer.grpo import group_advantages, policy_loss

MODEL = "tiny-qwen3"
OPT = OptimizerConfig(lr=1e-3, weight_decay=0.01, grad_clip=1.0)
LN = math.log


def test_weights_by_hand() -> None:
    trainer = torch.tensor([LN(3.0), 0.0, LN(0.5)], dtype=torch.float64)
    rollout = torch.zeros(3, dtype=torch.float64)
    w = raw_weights(trainer, rollout, "token")
    torch.testing.assert_close(w, torch.tensor([3.0, 1.0, 0.5], dtype=torch.float64), rtol=0, atol=1e-12)
    tis, over = apply_correction(w, "tis", 2.0)
    torch.testing.assert_close(tis, torch.tensor([2.0, 1.0, 0.5], dtype=torch.float64), rtol=0, atol=1e-12)
    assert over.tolist() == [True, False, False]
    mis, _ = apply_correction(w, "mis", 2.0)
    torch.testing.assert_close(mis, torch.tensor([0.0, 1.0, 0.5], dtype=torch.float64), rtol=0, atol=1e-12)
    seq = raw_weights(trainer, rollout, "sequence")  # the product 3 * 1 * 0.5 on every token
    torch.testing.assert_close(seq, torch.full((3,), 1.5, dtype=torch.float64), rtol=0, atol=1e-12)
    assert float(raw_weights(torch.tensor([100.0]), torch.tensor([0.0]), "token")) == pytest.approx(math.exp(20))


def test_statistics_by_hand() -> None:
    trainer = [torch.tensor([LN(3.0), 0.0]), torch.tensor([LN(0.5)])]
    rollout = [torch.zeros(2), torch.zeros(1)]
    weights, st = correction_weights(trainer, rollout, "mis", "token", 2.0)
    assert st.tokens == 3 and st.corrected_tokens == 1 and st.fraction == pytest.approx(1 / 3)
    assert st.count == 3 and st.ratio_sum == pytest.approx(4.5, abs=1e-6)
    expected = [0] * (len(RATIO_BUCKETS) + 1)
    for v in (3.0, 1.0, 0.5):
        expected[next((i for i, b in enumerate(RATIO_BUCKETS) if v <= b), len(RATIO_BUCKETS))] += 1
    assert list(st.bucket_counts) == expected
    assert histogram(torch.tensor([1.0]))[RATIO_BUCKETS.index(1.0)] == 1  # le=1.0 holds exactly 1
    _, seq = correction_weights(trainer, rollout, "tis", "sequence", 2.0)  # weights 3 (2 tokens) and 0.5
    assert seq.count == 2 and seq.corrected_tokens == 2 and seq.tokens == 3
    torch.testing.assert_close(weights[0], torch.tensor([0.0, 1.0]), rtol=0, atol=1e-6)


def _samples(lm: LoadedModel) -> list[TrainSample]:
    comps = RolloutEngine(lm, EngineConfig(kv_cache_tokens=1024)).generate(
        [[1, 2, 3, 4, 5], [40, 41, 42]], SamplingParams(temperature=1.0, max_new_tokens=8, n=2, seed=5,
                                                        ignore_eos=True))
    rewards = [sum(t % 2 == 0 for t in c.token_ids) / len(c.token_ids) for c in comps]
    return [TrainSample(prompt_ids=c.prompt_ids, token_ids=c.token_ids, old_logprobs=c.logprobs, advantage=a,
                        temperature=c.temperature)
            for c, a in zip(comps, group_advantages(rewards, 2), strict=True)]


_ROLLOUT: list[TrainSample] = []


@pytest.fixture
def samples(load_tiny: Callable[..., LoadedModel]) -> list[TrainSample]:
    if not _ROLLOUT:
        _ROLLOUT.extend(_samples(load_tiny(MODEL)))
    return list(_ROLLOUT)


def _loss_and_grads(engine: TrainerEngine, samples: list[TrainSample], loss: LossConfig,
                    weight: list[torch.Tensor] | None) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """The loss of the whole batch in one forward on the engine's model, and its parameter gradients."""
    model = engine.model
    new = torch.cat(pack_logprobs(model, [s.scored for s in samples]))
    old = torch.cat([torch.tensor(s.old_logprobs) for s in samples])
    adv = torch.tensor([s.advantage for s in samples])
    value, _ = policy_loss(new, old, adv, [len(s.token_ids) for s in samples], clip_eps_low=loss.clip_eps_low,
                           clip_eps_high=loss.clip_eps_high, loss_agg=loss.loss_agg,
                           weight=None if weight is None else torch.cat(weight))
    return value.detach(), list(torch.autograd.grad(value, engine.params))


@pytest.mark.parametrize(("mode", "level"), [("tis", "token"), ("mis", "token"), ("tis", "sequence"),
                                             ("mis", "sequence")])
def test_logdiff_zero_makes_the_correction_a_no_op(load_tiny: Callable[..., LoadedModel],
                                                   samples: list[TrainSample], mode: str, level: str) -> None:
    plain_loss = LossConfig(clip_eps_high=0.28)
    corrected = replace(plain_loss, correction_mode=mode, correction_level=level, correction_threshold=1.5)
    engine = TrainerEngine(load_tiny(MODEL, fresh=True))
    trainer_lp = engine.compute_logprobs([s.scored for s in samples])
    rollout_lp = [torch.tensor(s.old_logprobs) for s in samples]
    assert all(torch.equal(a, b) for a, b in zip(trainer_lp, rollout_lp, strict=True))  # logdiff 0
    weights, st = correction_weights(trainer_lp, rollout_lp, mode, level, 1.5)
    assert all(bool((w == 1).all()) for w in weights) and st.corrected_tokens == 0
    loss_a, grads_a = _loss_and_grads(engine, samples, plain_loss, None)
    loss_b, grads_b = _loss_and_grads(engine, samples, corrected, weights)
    assert torch.equal(loss_a, loss_b)
    assert all(torch.equal(a, b) for a, b in zip(grads_a, grads_b, strict=True))
    assert any(bool(g.abs().max() > 0) for g in grads_a)

    # the engine's step: same loss and bitwise the same weights after it
    other = TrainerEngine(load_tiny(MODEL, fresh=True))
    st_a = engine.train_step(samples, plain_loss, OPT)
    st_b = other.train_step(samples, corrected, OPT)
    assert st_a.loss == st_b.loss and st_a.grad_norm == st_b.grad_norm
    assert all(torch.equal(a, b) for a, b in zip(engine.model.state_dict().values(),
                                                 other.model.state_dict().values(), strict=True))
    assert st_b.correction.fraction == 0.0 and st_b.old_logprob_max_abs_diff == 0.0
    assert st_b.correction.bucket_counts[RATIO_BUCKETS.index(1.0)] == st_b.correction.count > 0
    assert st_b.correction.count == (st_b.tokens if level == "token" else len(samples))


def test_perturbed_rollout_logprob_changes_the_loss(load_tiny: Callable[..., LoadedModel],
                                                    samples: list[TrainSample]) -> None:
    """Negative control: a rollout logprob 1.0 below the trainer's gives that token a weight e > 1.5,
    which TIS truncates: the loss moves and the statistics say so."""
    lps = list(samples[0].old_logprobs)
    lps[2] -= 1.0
    bad = [replace(samples[0], old_logprobs=tuple(lps)), *samples[1:]]
    recompute = LossConfig(clip_eps_high=0.28)
    tis = replace(recompute, correction_mode="tis", correction_threshold=1.5)
    engine = TrainerEngine(load_tiny(MODEL, fresh=True))
    trainer_lp = engine.compute_logprobs([s.scored for s in bad])
    weights, st = correction_weights(trainer_lp, [torch.tensor(s.old_logprobs) for s in bad], "tis", "token", 1.5)
    assert st.corrected_tokens == 1 and float(weights[0][2]) == 1.5
    fresh = [replace(s, old_logprobs=tuple(lp.tolist())) for s, lp in zip(bad, trainer_lp, strict=True)]
    loss_a, _ = _loss_and_grads(engine, fresh, recompute, None)
    loss_b, _ = _loss_and_grads(engine, fresh, tis, weights)
    assert not torch.equal(loss_a, loss_b)
    step = engine.train_step(bad, tis, OPT)
    assert step.correction.corrected_tokens == 1 and step.old_logprob_max_abs_diff == pytest.approx(1.0, abs=1e-6)
    assert step.correction.bucket_counts[-1] == 0 and sum(step.correction.bucket_counts[-3:]) == 1  # e in (2, 5]


def test_train_step_response_and_trainer_histogram(load_tiny: Callable[..., LoadedModel],
                                                   samples: list[TrainSample]) -> None:
    servicer = TrainerServicer(TrainerEngine(load_tiny(MODEL, fresh=True)))
    metrics = TrainerMetrics(servicer, job="j")
    lps = list(samples[1].old_logprobs)
    lps[0] -= 1.0
    req = trainer_pb2.TrainStepRequest(
        samples=[trainer_pb2.TrainSample(prompt_ids=s.prompt_ids, token_ids=s.token_ids,
                                         old_logprobs=lps if i == 1 else s.old_logprobs, advantage=s.advantage,
                                         temperature=s.temperature) for i, s in enumerate(samples)],
        loss=trainer_pb2.LossConfig(clip_eps_low=0.2, clip_eps_high=0.28, loss_agg="token-mean",
                                    correction_mode="mis", correction_threshold=1.5, entropy_coef=0.01),
        optimizer=trainer_pb2.OptimizerConfig(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0,
                                              grad_clip=1.0))
    resp = servicer.TrainStep(req, None)
    tokens = sum(len(s.token_ids) for s in samples)
    assert resp.correction_fraction == pytest.approx(1 / tokens)
    assert list(resp.correction_ratio_bounds) == list(RATIO_BUCKETS) and sum(resp.correction_ratio_counts) == tokens
    assert resp.entropy > 0
    text = generate_latest(metrics.registry).decode()
    assert f'onpolicy_trainer_correction_ratio_count{{job="j",model="{MODEL}",role="trainer"}} {float(tokens)}' in text
    assert 'onpolicy_trainer_correction_ratio_bucket{job="j",le="1.0"' in text
    assert f'onpolicy_trainer_correction_fraction{{job="j",model="{MODEL}",role="trainer"}} {1 / tokens}' in text
    assert 'onpolicy_trainer_entropy{job="j"' in text
