"""The losses of GRPO, GSPO, DAPO and Dr. GRPO against hand-computed cases; the advantage std switch,
DAPO's dynamic-sampling filter and overlong penalty, the entropy bonus (and its analytic backward)
and the LR schedule; one GRPO step's loss and parameter gradient re-derived with TRL's
``GRPOTrainer`` loss on a real model."""

from __future__ import annotations

import math
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from onpolicy.kernels.backend import TokenLogprobs, TokenLogprobsEntropy, at_targets
from onpolicy.models.context import PackedContext
from onpolicy.models.loading import LoadedModel
from onpolicy.trainer.forward import ScoredSequence, pack_logprobs
from onpolicy.trainer.grpo import (
    group_advantages,
    informative_groups,
    loss_normalizer,
    overlong_penalty,
    policy_loss,
    scheduled_lr,
)

LN = math.log


def _t(*xs: float) -> torch.Tensor:
    return torch.tensor(xs, dtype=torch.float64)


# Two sequences (2 and 1 tokens). Ratios: 1.5, 0.5 (sequence 0), 1.1 (sequence 1).
NEW = _t(LN(1.5), LN(0.5), LN(1.1))
OLD = _t(0.0, 0.0, 0.0)
LENGTHS = [2, 1]
ADV = _t(1.0, -2.0)  # per sequence


def _loss(**kw: Any) -> float:
    kw.setdefault("clip_eps_low", 0.2)
    kw.setdefault("clip_eps_high", 0.28)
    value, _ = policy_loss(NEW, OLD, ADV, LENGTHS, **kw)
    return float(value)


def test_grpo_token_mean_by_hand() -> None:
    # token 0: A=1, r=1.5 -> max(-1.5, -1.28) = -1.28 (clipped); token 1: A=1, r=0.5 -> max(-0.5, -0.8)
    # = -0.5; token 2: A=-2, r=1.1 -> max(2.2, 2.2) = 2.2. token-mean: (-1.28 - 0.5 + 2.2) / 3.
    assert _loss() == pytest.approx((-1.28 - 0.5 + 2.2) / 3, abs=1e-12)
    # seq-mean: ((-1.28 - 0.5) / 2 + 2.2) / 2.
    assert _loss(loss_agg="seq-mean") == pytest.approx(((-1.28 - 0.5) / 2 + 2.2) / 2, abs=1e-12)


def test_dapo_clip_higher_and_token_level_aggregation_by_hand() -> None:
    # clip-higher: with eps_high 0.6 the 1.5 ratio of a positive advantage is not clipped (-1.5).
    assert _loss(clip_eps_high=0.6) == pytest.approx((-1.5 - 0.5 + 2.2) / 3, abs=1e-12)
    _, st = policy_loss(NEW, OLD, ADV, LENGTHS, clip_eps_low=0.2, clip_eps_high=0.28)
    assert st.clip_fraction == pytest.approx(1 / 3)  # token 0


def test_gspo_sequence_ratio_by_hand() -> None:
    # sequence 0: s = exp((ln 1.5 + ln 0.5) / 2) = sqrt(0.75) ~ 0.866, below the clip range; with A = 1,
    # max(-s, -clip(s)) = -s (the pessimistic, unclipped term). Sequence 1: s = 1.1, A = -2: 2 * 1.1.
    s0 = math.sqrt(0.75)
    lo, hi = 1 - 3e-4, 1 + 4e-4
    l0 = max(-1 * s0, -1 * min(max(s0, lo), hi))  # = -s0
    s1 = 1.1
    l1 = max(2 * s1, 2 * min(max(s1, lo), hi))  # = 2.2
    got = _loss(ratio_level="sequence", loss_agg="seq-mean", clip_eps_low=3e-4, clip_eps_high=4e-4)
    assert got == pytest.approx((l0 + l1) / 2, abs=1e-12)
    # the ratio is one value per sequence: its gradient is s / |y| on each token of the sequence
    new = NEW.clone().requires_grad_(True)
    value, _ = policy_loss(new, OLD, ADV, LENGTHS, clip_eps_low=0.5, clip_eps_high=0.5, ratio_level="sequence",
                           loss_agg="seq-mean")
    value.backward()
    assert new.grad is not None
    torch.testing.assert_close(new.grad, _t(-s0 / 2 / 2, -s0 / 2 / 2, 2 * 1.1 / 2), rtol=0, atol=1e-12)


def test_dr_grpo_token_sum_over_constant_and_no_std_by_hand() -> None:
    # sum of token losses / (2 sequences * horizon 4)
    assert _loss(loss_agg="seq-mean-token-sum-norm", horizon=4) == pytest.approx((-1.28 - 0.5 + 2.2) / 8, abs=1e-12)
    assert loss_normalizer("seq-mean-token-sum-norm", [2, 1], 4) == 8.0
    assert loss_normalizer("token-mean", [2, 1]) == 3.0 and loss_normalizer("seq-mean", [2, 1]) == 2.0
    with pytest.raises(ValueError, match="horizon"):
        _loss(loss_agg="seq-mean-token-sum-norm")
    # scale_rewards off: centred only; on: divided by the unbiased std (+ eps)
    assert group_advantages([1.0, 0.0, 0.0, 0.0], 4, normalize_std=False) == [0.75, -0.25, -0.25, -0.25]
    std = math.sqrt((0.75 ** 2 + 3 * 0.25 ** 2) / 3)
    assert group_advantages([1.0, 0.0, 0.0, 0.0], 4)[0] == pytest.approx(0.75 / (std + 1e-6), abs=1e-12)


def test_entropy_bonus_by_hand() -> None:
    ent = _t(0.5, 1.0, 2.0)
    base = _loss()
    assert _loss(entropy=ent, entropy_coef=0.1) == pytest.approx(base - 0.1 * 3.5 / 3, abs=1e-12)
    # under gradient accumulation the divisor is the minibatch's token count
    assert _loss(entropy=ent, entropy_coef=0.1, entropy_normalizer=7.0) == pytest.approx(base - 0.1 * 3.5 / 7,
                                                                                       abs=1e-12)
    _, st = policy_loss(NEW, OLD, ADV, LENGTHS, clip_eps_low=0.2, clip_eps_high=0.2, entropy=ent)
    assert st.entropy == pytest.approx(3.5 / 3)
    with pytest.raises(ValueError, match="entropy"):
        _loss(entropy_coef=0.1)


def test_correction_weight_multiplies_the_policy_term_by_hand() -> None:
    w = _t(1.0, 0.0, 2.0)
    assert _loss(weight=w) == pytest.approx((-1.28 + 0.0 + 4.4) / 3, abs=1e-12)


def test_dynamic_sampling_filter_and_overlong_penalty() -> None:
    assert informative_groups([1, 1, 0, 1, 0.5, 0.5], 2) == [False, True, False]
    # DAPO: max 20, buffer 4: no penalty up to 16 tokens, then linear to -factor at 20
    assert [overlong_penalty(n, 20, 4) for n in (10, 16, 17, 18, 20)] == [0.0, 0.0, -0.25, -0.5, -1.0]
    assert overlong_penalty(20, 20, 4, factor=0.5) == -0.5
    assert overlong_penalty(20, 20, 0) == 0.0


def test_lr_schedule_by_hand() -> None:
    assert [scheduled_lr(1.0, s, 10, "constant", 4) for s in (0, 1, 3, 4, 9)] == [0.25, 0.5, 1.0, 1.0, 1.0]
    # cosine over the 6 steps after warmup: step 4 -> 1, step 7 -> (1 + cos(pi/2)) / 2 = 0.5
    assert scheduled_lr(1.0, 4, 10, "cosine", 4) == 1.0
    assert scheduled_lr(1.0, 7, 10, "cosine", 4) == pytest.approx(0.5, abs=1e-12)
    assert scheduled_lr(2.0, 9, 10, "cosine") == pytest.approx(1.0 + math.cos(math.pi * 0.9), abs=1e-12)
    assert scheduled_lr(2.0, 9, 10, "cosine") > 0
    with pytest.raises(ValueError):
        scheduled_lr(1.0, 10, 10)


# --------------------------------------------------------------------------- the entropy kernel
def _head_case() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(5, 8, generator=g)
    head = torch.randn(11, 8, generator=g)
    temp = torch.tensor([1.0, 0.7, 1.0, 1.3, 1.0])
    targets = torch.tensor([3, 0, 10, 5, 5])
    return hidden, head, temp, targets


def _logprobs(h: torch.Tensor, w: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    return torch.log_softmax((h @ w.T) / t[:, None], dim=-1)


def test_entropy_kernel_gradient_matches_autograd() -> None:
    hidden, head, temp, targets = _head_case()
    g_tok, g_ent = _t(1, -2, 3, 0.5, 1).float(), _t(0.3, 1, -1, 2, 0.1).float()
    a, b = hidden.clone().requires_grad_(True), head.clone().requires_grad_(True)
    tok, ent = TokenLogprobsEntropy.apply(a, b, temp, targets, _logprobs)
    (tok * g_tok).sum().add((ent * g_ent).sum()).backward()
    x, y = hidden.clone().requires_grad_(True), head.clone().requires_grad_(True)
    lp = _logprobs(x, y, temp)
    ref_ent = -(lp.exp() * lp).sum(-1)
    (at_targets(lp, targets) * g_tok).sum().add((ref_ent * g_ent).sum()).backward()
    torch.testing.assert_close(ent, ref_ent, rtol=0, atol=1e-5)
    torch.testing.assert_close(a.grad, x.grad, rtol=0, atol=1e-5)
    torch.testing.assert_close(b.grad, y.grad, rtol=0, atol=1e-5)
    assert float(a.grad.abs().max()) > 1e-2


def test_entropy_kernel_without_entropy_gradient_is_token_logprobs_bitwise() -> None:
    hidden, head, temp, targets = _head_case()
    grads = []
    for fn in (TokenLogprobs, TokenLogprobsEntropy):
        a, b = hidden.clone().requires_grad_(True), head.clone().requires_grad_(True)
        out = fn.apply(a, b, temp, targets, _logprobs)
        tok = out[0] if isinstance(out, tuple) else out
        (tok * torch.tensor([1.0, -2.0, 3.0, 0.5, 1.0])).sum().backward()
        grads.append((tok.detach(), a.grad, b.grad))
    assert all(torch.equal(x, y) for x, y in zip(*grads, strict=True))


def test_entropy_on_a_real_model_keeps_the_logprob_bits(load_tiny: Callable[..., LoadedModel]) -> None:
    model = load_tiny("tiny-qwen3").model
    seqs = [ScoredSequence((1, 2, 3), (4, 5, 6, 7), 1.0), ScoredSequence((9, 8), (7, 6), 0.7)]
    with torch.no_grad():
        plain = pack_logprobs(model, seqs)
        ent: list[torch.Tensor] = []
        with_entropy = pack_logprobs(model, seqs, entropy=ent)
        full = [_full_logprobs(model, s) for s in seqs]
    assert all(torch.equal(x, y) for x, y in zip(plain, with_entropy, strict=True))
    assert [e.shape for e in ent] == [p.shape for p in plain]
    vocab = model.config.vocab_size
    for e, lp in zip(ent, full, strict=True):
        torch.testing.assert_close(e, -(lp.exp() * lp).sum(-1), rtol=0, atol=1e-5)
        assert bool(((e > 0) & (e <= math.log(vocab) + 1e-4)).all())


def _full_logprobs(model: Any, s: ScoredSequence) -> torch.Tensor:
    """The full log-softmax ``[len(token_ids), V]`` at one sequence's continuation rows."""
    ids = torch.tensor([*s.prompt_ids, *s.token_ids[:-1]], dtype=torch.int64)
    ctx = PackedContext([s.input_len], model.device)
    first = len(s.prompt_ids) - 1
    rows = model.hidden(ids, ctx.positions, ctx, None)[first:first + len(s.token_ids)]
    return model.logprobs(rows, torch.full((len(s.token_ids),), s.temperature))


# --------------------------------------------------------------------------- TRL's GRPOTrainer loss
trl_grpo = pytest.importorskip("trl.trainer.grpo_trainer")


def _trl_self(per_token_logps: torch.Tensor, loss_type: str, level: str, eps_low: float, eps_high: float,
              max_len: int) -> SimpleNamespace:
    """What ``GRPOTrainer._compute_loss`` reads of ``self``, with the policy's logprobs given."""
    acc = SimpleNamespace(gather=lambda x: x, gather_for_metrics=lambda x: x, reduce=lambda x, reduction: x,
                          num_processes=1, sync_gradients=True)
    class _Metrics(dict):  # type: ignore[type-arg]
        def __missing__(self, key: str) -> list[float]:
            self[key] = []
            return self[key]

    return SimpleNamespace(
        _get_per_token_logps_and_entropies=lambda *a, **k: (per_token_logps, torch.zeros_like(per_token_logps),
                                                            None),
        aux_loss_enabled=False, top_entropy_quantile=1.0, off_policy_mask_threshold=None,
        importance_sampling_level=level, beta=0.0,
        args=SimpleNamespace(delta=None, use_bias_correction_kl=False, steps_per_generation=1),
        loss_type=loss_type, epsilon_low=eps_low, epsilon_high=eps_high, use_vllm=False,
        model=SimpleNamespace(training=True), current_gradient_accumulation_steps=1, max_completion_length=max_len,
        _entropy_bonus_enabled=False, accelerator=acc, _metrics={"train": _Metrics(), "eval": _Metrics()})


def _padded(flat: torch.Tensor, lengths: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    rows = flat.split(lengths)
    width = max(lengths)
    out = torch.stack([torch.cat([r, r.new_zeros(width - len(r))]) for r in rows])
    mask = torch.stack([torch.arange(width) < n for n in lengths]).to(flat.dtype)
    return out, mask


CASES = [  # (TRL loss_type, TRL importance level, our loss_agg, our ratio level, eps low, eps high)
    ("grpo", "token", "seq-mean", "token", 0.2, 0.28),
    ("bnpo", "token", "token-mean", "token", 0.2, 0.28),
    ("dapo", "token", "token-mean", "token", 0.2, 0.28),
    ("dr_grpo", "token", "seq-mean-token-sum-norm", "token", 0.2, 0.2),
    ("grpo", "sequence", "seq-mean", "sequence", 3e-4, 4e-4),  # GSPO
]


@pytest.mark.parametrize(("loss_type", "level", "loss_agg", "ratio_level", "low", "high"), CASES,
                         ids=[f"{c[0]}-{c[1]}" for c in CASES])
def test_one_step_loss_and_gradient_equal_trl(load_tiny: Callable[..., LoadedModel], loss_type: str, level: str,
                                             loss_agg: str, ratio_level: str, low: float, high: float) -> None:
    lm = load_tiny("tiny-qwen3", fresh=True)
    model = lm.model.requires_grad_(True)
    params = [p for p in model.parameters() if p.requires_grad]
    seqs = [ScoredSequence((1, 2, 3), (4, 5, 6, 7, 8), 1.0), ScoredSequence((9, 8, 7), (6, 5), 1.0),
            ScoredSequence((11, 12), (13, 14, 15), 1.0), ScoredSequence((20,), (21, 22, 23, 24), 1.0)]
    lengths = [len(s.token_ids) for s in seqs]
    rewards = [1.0, 0.0, 0.5, 0.0]
    adv = torch.tensor(group_advantages(rewards, 2), dtype=torch.float32)
    with torch.no_grad():  # old logprobs off the current ones so that ratios differ from 1 and some clip
        base = torch.cat(pack_logprobs(model, seqs))
        old = base + torch.linspace(-0.4, 0.4, base.shape[0])
    horizon = 6

    new = torch.cat(pack_logprobs(model, seqs))
    ours, _ = policy_loss(new, old, adv, lengths, clip_eps_low=low, clip_eps_high=high, loss_agg=loss_agg,
                          ratio_level=ratio_level, horizon=horizon)
    ours_grads = torch.autograd.grad(ours, params)

    new_t = torch.cat(pack_logprobs(model, seqs))
    per_token, mask = _padded(new_t, lengths)
    old_pad, _ = _padded(old, lengths)
    inputs = {"prompt_ids": torch.zeros(4, 1, dtype=torch.long), "prompt_mask": torch.ones(4, 1),
              "completion_ids": torch.zeros(4, max(lengths), dtype=torch.long), "completion_mask": mask,
              "advantages": adv, "old_per_token_logps": old_pad, "num_items_in_batch": mask.sum()}
    trl_self = _trl_self(per_token, loss_type, level, low, high, horizon)
    theirs = trl_grpo.GRPOTrainer._compute_loss(trl_self, None, inputs)
    theirs_grads = torch.autograd.grad(theirs, params)

    a, b = float(ours.detach()), float(theirs.detach())
    assert abs(a - b) <= 1e-6, (a, b)
    assert a != 0.0
    for a, b in zip(ours_grads, theirs_grads, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6)
    assert any(bool(g.abs().max() > 1e-4) for g in ours_grads)


def test_trl_style_advantages_equal_ours() -> None:
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 0.2, 0.9, 0.4, 0.4], dtype=torch.float64)
    grouped = rewards.view(-1, 4)
    trl_style = (grouped - grouped.mean(1, keepdim=True)) / (grouped.std(1, keepdim=True) + 1e-6)
    ours = torch.tensor(group_advantages(rewards.tolist(), 4), dtype=torch.float64)
    torch.testing.assert_close(ours, trl_style.flatten(), rtol=0, atol=1e-6)
