"""GRPO advantages and the PPO-clip loss on hand-computed examples."""

from __future__ import annotations

import math

import pytest
import torch

from onpolicy.trainer.grpo import group_advantages, kl_penalty, policy_loss

F64 = torch.float64


def test_group_advantages_centre_and_scale_per_group() -> None:
    s = math.sqrt(0.5)  # unbiased std of [1, 0]
    got = group_advantages([1.0, 0.0, 0.0, 1.0], group_size=2)
    assert got == pytest.approx([0.5 / (s + 1e-6), -0.5 / (s + 1e-6), -0.5 / (s + 1e-6), 0.5 / (s + 1e-6)], abs=1e-15)
    assert group_advantages([1.0, 0.0, 0.0, 1.0], 2, normalize_std=False) == [0.5, -0.5, -0.5, 0.5]
    # group [3, 5, 7]: mean 5, unbiased std 2
    assert group_advantages([3.0, 5.0, 7.0], 3, eps=0.0) == [-1.0, 0.0, 1.0]
    # groups are independent
    assert group_advantages([3.0, 5.0, 7.0, 10.0, 10.0, 10.0], 3, eps=0.0)[3:] == [0.0, 0.0, 0.0]


def test_group_advantages_degenerate_groups() -> None:
    assert group_advantages([2.0, 2.0, 2.0], 3) == [0.0, 0.0, 0.0]  # no signal: 0 / (0 + eps)
    assert group_advantages([4.0, -1.0], 1) == [0.0, 0.0]  # a group of one has nothing to compare with
    with pytest.raises(ValueError, match="groups of 3"):
        group_advantages([1.0, 2.0], 3)
    with pytest.raises(ValueError, match="group_size"):
        group_advantages([1.0], 0)
    with pytest.raises(ValueError, match="finite"):
        group_advantages([1.0, math.nan], 2)


def _case() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    new = torch.tensor([math.log(1.5), math.log(0.5), 0.0], dtype=F64, requires_grad=True)
    return new, torch.zeros(3, dtype=F64), torch.tensor([1.0, 1.0, -1.0], dtype=F64)


def test_clip_is_asymmetric_and_blocks_gradient() -> None:
    new, old, adv = _case()
    loss, st = policy_loss(new, old, adv, [3], clip_eps_low=0.2, clip_eps_high=0.3)
    # tok0: r=1.5, A=+1 -> max(-1.5, -1.3) = -1.3 (clipped at 1 + 0.3); tok1: r=0.5, A=+1 -> max(-0.5, -0.8)
    # = -0.5 (the lower clip never binds for A > 0); tok2: r=1, A=-1 -> 1
    assert float(loss.detach()) == pytest.approx((-1.3 - 0.5 + 1.0) / 3, abs=1e-12)
    assert st.clip_fraction == pytest.approx(1 / 3)
    assert st.tokens == 3 and st.kl == 0.0
    assert st.approx_kl == pytest.approx(((1.5 - 1 - math.log(1.5)) + (0.5 - 1 - math.log(0.5))) / 3, abs=1e-7)
    loss.backward()
    assert new.grad is not None
    # d/dlp of -A r / 3 = -A r / 3; the clipped token gets none
    assert new.grad.tolist() == pytest.approx([0.0, -0.5 / 3, 1.0 / 3], abs=1e-12)

    # negative advantages: now the lower clip binds (r=0.5 -> 0.8) and the upper one does not
    new2 = torch.tensor([math.log(1.5), math.log(0.5)], dtype=F64)
    loss2, st2 = policy_loss(new2, torch.zeros(2, dtype=F64), torch.tensor([-1.0, -1.0], dtype=F64), [2],
                             clip_eps_low=0.2, clip_eps_high=0.3)
    assert float(loss2) == pytest.approx((1.5 + 0.8) / 2, abs=1e-12)
    assert st2.clip_fraction == 0.5
    # a wider low clip lets r=0.5 through unclipped
    loss3, st3 = policy_loss(new2, torch.zeros(2, dtype=F64), torch.tensor([-1.0, -1.0], dtype=F64), [2],
                             clip_eps_low=0.6, clip_eps_high=0.3)
    assert float(loss3) == pytest.approx((1.5 + 0.5) / 2, abs=1e-12) and st3.clip_fraction == 0.0


def test_token_mean_vs_seq_mean_and_normalizer() -> None:
    new, old, adv = _case()
    new = new.detach()
    per_token = [-1.3, -0.5, 1.0]
    tok, _ = policy_loss(new, old, adv, [2, 1], clip_eps_low=0.2, clip_eps_high=0.3, loss_agg="token-mean")
    seq, _ = policy_loss(new, old, adv, [2, 1], clip_eps_low=0.2, clip_eps_high=0.3, loss_agg="seq-mean")
    assert float(tok) == pytest.approx(sum(per_token) / 3, abs=1e-12)
    assert float(seq) == pytest.approx(((-1.3 - 0.5) / 2 + 1.0) / 2, abs=1e-12)
    # per-sequence advantages broadcast over each sequence's tokens
    seq_adv, _ = policy_loss(new, old, torch.tensor([1.0, -1.0], dtype=F64), [2, 1], clip_eps_low=0.2,
                             clip_eps_high=0.3)
    assert float(seq_adv) == float(tok)
    # microbatches with the minibatch's normalizer add up to the minibatch's loss
    for agg, norm in (("token-mean", 3.0), ("seq-mean", 2.0)):
        whole, _ = policy_loss(new, old, adv, [2, 1], clip_eps_low=0.2, clip_eps_high=0.3, loss_agg=agg)
        a, _ = policy_loss(new[:2], old[:2], adv[:2], [2], clip_eps_low=0.2, clip_eps_high=0.3, loss_agg=agg,
                           normalizer=norm)
        b, _ = policy_loss(new[2:], old[2:], adv[2:], [1], clip_eps_low=0.2, clip_eps_high=0.3, loss_agg=agg,
                           normalizer=norm)
        assert float(a + b) == pytest.approx(float(whole), abs=1e-12)


def test_kl_estimators() -> None:
    lp = torch.tensor([math.log(0.5), math.log(0.2)], dtype=F64)
    ref = torch.tensor([math.log(0.25), math.log(0.2)], dtype=F64)
    assert kl_penalty(lp, ref, "k1").tolist() == pytest.approx([math.log(2), 0.0], abs=1e-12)
    # k3 = exp(ref - lp) - (ref - lp) - 1 = 0.5 + log 2 - 1
    assert kl_penalty(lp, ref, "k3").tolist() == pytest.approx([0.5 + math.log(2) - 1, 0.0], abs=1e-12)
    with pytest.raises(ValueError, match="kl_estimator"):
        kl_penalty(lp, ref, "k2")  # type: ignore[arg-type]
    # in the loss: ratio 1 (new == old), advantage 0, so the loss is the KL term alone
    for est, want in (("k1", math.log(2) / 2), ("k3", (0.5 + math.log(2) - 1) / 2)):
        loss, st = policy_loss(lp, lp.clone(), torch.zeros(2, dtype=F64), [2], clip_eps_low=0.2, clip_eps_high=0.2,
                               kl_coef=0.1, kl_estimator=est, ref_lp=ref)
        assert float(loss) == pytest.approx(0.1 * want, abs=1e-12)
        assert st.kl == pytest.approx(want, abs=1e-12)
    # kl_coef 0 ignores the reference entirely
    loss0, st0 = policy_loss(lp, lp.clone(), torch.zeros(2, dtype=F64), [2], clip_eps_low=0.2, clip_eps_high=0.2,
                             kl_coef=0.0, ref_lp=ref)
    assert float(loss0) == 0.0 and st0.kl == 0.0


def test_policy_loss_rejects_bad_inputs() -> None:
    new, old, adv = _case()
    kw = {"clip_eps_low": 0.2, "clip_eps_high": 0.2}
    with pytest.raises(ValueError, match="lengths"):
        policy_loss(new, old, adv, [2], **kw)
    with pytest.raises(ValueError, match="equal shape"):
        policy_loss(new, old[:2], adv, [3], **kw)
    with pytest.raises(ValueError, match="loss_agg"):
        policy_loss(new, old, adv, [3], loss_agg="sum", **kw)
    with pytest.raises(ValueError, match="clip_eps_low"):
        policy_loss(new, old, adv, [3], clip_eps_low=1.0, clip_eps_high=0.2)
    with pytest.raises(ValueError, match="ref_lp"):
        policy_loss(new, old, adv, [3], kl_coef=0.1, **kw)
    with pytest.raises(ValueError, match="advantages"):
        policy_loss(new, old, adv[:2], [3], **kw)
