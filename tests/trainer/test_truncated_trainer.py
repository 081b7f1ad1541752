"""The trainer under top-k / top-p / min-p truncation: ``Backend.token_logprobs`` with a
``RowTruncation`` has the bits of the truncated log-softmax with or without autograd, its analytic
backward is autograd's through the masked log-softmax (the kept set a constant) and gives excluded
tokens' logits a zero gradient, and a train step on truncated rollouts is bitwise on-policy
(recomputed old logprobs equal the rollout's) while the same samples scored untruncated are not."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from onpolicy.kernels import KernelConfig, get_backend
from onpolicy.kernels.truncation import NONE, RowTruncation, Truncation, truncate
from onpolicy.models.loading import LoadedModel
from onpolicy.rollout import EngineConfig, RolloutEngine, SamplingParams
from onpolicy.trainer.config import LossConfig, OptimizerConfig, TrainSample
from onpolicy.trainer.engine import TrainerEngine
from onpolicy.trainer.grpo import group_advantages

TRUNCS = [Truncation(top_p=0.7), Truncation(top_k=4), Truncation(min_p=0.3), NONE,
          Truncation(top_k=50, top_p=0.9, min_p=0.05), Truncation(top_p=0.5)]


def _operands(n: int = 6, h: int = 32, v: int = 301):
    gen = torch.Generator().manual_seed(5)
    hidden = torch.randn(n, h, generator=gen)
    lm_head = torch.randn(v, h, generator=gen) * 0.6
    temperature = torch.tensor([1.0, 0.7, 1.3, 1.0, 0.5, 2.0][:n])
    return hidden, lm_head, temperature


def _targets(lp: torch.Tensor) -> torch.Tensor:
    """A kept token of every row (the rollout only ever samples kept tokens)."""
    return torch.where(lp > float("-inf"), torch.arange(lp.shape[1]), -1).max(dim=1).values


@pytest.mark.parametrize("backend", ["reference", "fast"])
def test_forward_bits_and_analytic_gradient(backend: str) -> None:
    ops = get_backend(KernelConfig(backend=backend))
    hidden, lm_head, temperature = _operands()
    trunc = RowTruncation.of(TRUNCS)
    full = truncate(ops.logprobs(hidden, lm_head, temperature), trunc)
    targets = _targets(full)
    plain = full.gather(1, targets[:, None])[:, 0]
    assert torch.equal(ops.token_logprobs(hidden, lm_head, temperature, targets, trunc), plain)

    up = torch.randn(len(TRUNCS), generator=torch.Generator().manual_seed(6))
    h1, w1 = hidden.clone().requires_grad_(), lm_head.clone().requires_grad_()
    got = ops.token_logprobs(h1, w1, temperature, targets, trunc)
    assert got.grad_fn is not None and torch.equal(got.detach(), plain)  # TokenLogprobs: the same bits
    (got * up).sum().backward()

    # independent: autograd through logits / t, the kept set as a constant mask, log-softmax
    h2, w2 = hidden.clone().requires_grad_(), lm_head.clone().requires_grad_()
    keep = full > float("-inf")
    logits = (h2 @ w2.T) / temperature[:, None]
    want = torch.log_softmax(logits.masked_fill(~keep, float("-inf")), -1).gather(1, targets[:, None])[:, 0]
    (want * up).sum().backward()
    torch.testing.assert_close(h1.grad, h2.grad, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(w1.grad, w2.grad, rtol=1e-4, atol=1e-5)


def test_excluded_tokens_logits_get_a_zero_gradient() -> None:
    ops = get_backend(KernelConfig())
    hidden, lm_head, temperature = _operands(n=1)
    for t in TRUNCS[:3]:
        trunc = RowTruncation.of([t])
        keep = truncate(ops.logprobs(hidden, lm_head, temperature), trunc)[0] > float("-inf")
        assert 0 < int(keep.sum()) < lm_head.shape[0]
        w = lm_head.clone().requires_grad_()
        ops.token_logprobs(hidden, w, temperature, _targets(keep[None].float().log()), trunc).sum().backward()
        # one row: the LM-head row of token v gets d logit_v * hidden, so exactly 0 iff v is excluded
        assert bool((w.grad[~keep] == 0).all())
        assert bool((w.grad[keep].abs().sum(-1) > 0).all())
        # autograd path (a differentiable temperature): truncate passes excluded tokens no gradient
        full = torch.log_softmax((hidden @ lm_head.T) / temperature[:, None], -1).requires_grad_()
        lp = truncate(full, trunc)
        lp[0, _targets(lp.detach())].sum().backward()
        assert bool((full.grad[0, ~keep] == 0).all()) and bool((full.grad[0, keep] != 0).any())
        # (autograd's log-softmax backward then gives an excluded logit -p_v * sum(kept grads), zero
        # only up to rounding of 1 - sum(q): that is torch's arithmetic, machine-dependent, not asserted)


def _truncated_samples(lm: LoadedModel, trunc: Truncation) -> list[TrainSample]:
    prompts = [[1, 2, 3, 4, 5], [40, 41, 42], [100, 7, 9, 11, 13, 15, 17]]
    comps = RolloutEngine(lm, EngineConfig(kv_cache_tokens=1024)).generate(
        prompts, SamplingParams(temperature=0.6, max_new_tokens=10, n=2, seed=3, ignore_eos=True, **trunc.to_dict()))
    rewards = [sum(t % 2 == 0 for t in c.token_ids) / len(c.token_ids) for c in comps]
    return [TrainSample(prompt_ids=c.prompt_ids, token_ids=c.token_ids, old_logprobs=c.logprobs, advantage=a,
                        temperature=c.temperature, **c.truncation.to_dict())
            for c, a in zip(comps, group_advantages(rewards, 2), strict=True)]


def test_train_step_on_truncated_rollouts_is_bitwise_on_policy(load_tiny: Callable[..., LoadedModel]) -> None:
    lm = load_tiny("tiny-qwen3", fresh=True)
    samples = _truncated_samples(lm, Truncation(top_k=40, top_p=0.8))
    loss, opt = LossConfig(kl_coef=0.05), OptimizerConfig(lr=1e-3)
    trainer = TrainerEngine(lm)
    stats = trainer.train_step(samples, loss, opt, recompute_old=True)
    assert stats.old_logprob_max_abs_diff == 0.0 and stats.grad_norm > 0
    # negative control: the same rollouts without their truncation are off-policy by construction
    other = TrainerEngine(load_tiny("tiny-qwen3", fresh=True))
    untruncated = [TrainSample(prompt_ids=s.prompt_ids, token_ids=s.token_ids, old_logprobs=s.old_logprobs,
                               advantage=s.advantage, temperature=s.temperature) for s in samples]
    bad = other.train_step(untruncated, loss, opt, recompute_old=True)
    assert bad.old_logprob_max_abs_diff > 1e-3
