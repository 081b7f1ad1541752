"""The doctor under top-k / top-p / min-p truncation: both replays use the sample's truncation
(bitwise equal, reproducing the recorded logprobs), and a truncation that differs between the paths
is a framework fault with cause ``truncation`` at the LM head's ``truncate`` step."""

from __future__ import annotations

from collections.abc import Callable

import torch
from doctor_support import FINGERPRINT, PROMPT_IDS

from onpolicy.kernels.truncation import Truncation
from onpolicy.verification.doctor import ADVICE, CAUSES, diagnose, diagnose_sample

TRUNC = Truncation(top_k=60, top_p=0.8)


def test_same_truncation_on_both_paths_is_consistent(loader: Callable[[str, str], object]) -> None:
    d = diagnose("tiny-qwen3", prompt_ids=PROMPT_IDS, kernel_fingerprint=FINGERPRINT, loader=loader,
                 temperature=0.7, truncation=TRUNC, max_new_tokens=12, seed=3)
    assert not d.divergent and d.klass == "none", d.format()
    assert d.facts["truncation"] == {"rollout": TRUNC.to_dict(), "trainer": TRUNC.to_dict(), "differ": False}
    assert d.tokens == 12 and d.max_abs_logdiff == 0


def test_untruncated_trainer_is_a_truncation_fault(loader: Callable[[str, str], object]) -> None:
    d = diagnose("tiny-qwen3", prompt_ids=PROMPT_IDS, kernel_fingerprint=FINGERPRINT, loader=loader,
                 temperature=0.7, truncation=TRUNC, trainer="top_p=1.0,top_k=0", max_new_tokens=12, seed=3)
    assert d.divergent and (d.klass, d.cause, d.op) == ("framework", "truncation", "truncate"), d.format()
    assert d.module == "lm_head" and d.layer is None
    assert d.differing_inputs == ["top_k", "top_p"]
    assert d.facts["truncation"]["differ"] and d.mismatched_tokens == d.tokens > 0
    assert d.swap["rollout_op_on_trainer_inputs"] is True  # on the trainer's parameters: the trainer's bits
    assert "truncation" in CAUSES and "top_p" in ADVICE["truncation"] and d.advice == ADVICE["truncation"]
    assert "truncation" in d.format()


def test_a_recorded_truncated_sample_replays_bit_for_bit(loader: Callable[[str, str], object]) -> None:
    from onpolicy.rollout import EngineConfig, RolloutEngine, SamplingParams

    lm = loader("tiny-qwen3", "fp32")
    (c,) = RolloutEngine(lm, EngineConfig(kv_cache_tokens=256)).generate(  # type: ignore[arg-type]
        [PROMPT_IDS], SamplingParams(temperature=0.7, max_new_tokens=10, seed=9, ignore_eos=True, **TRUNC.to_dict()))
    sample = {"model": "tiny-qwen3", "kernel_fingerprint": FINGERPRINT, "prompt_ids": list(c.prompt_ids),
              "token_ids": list(c.token_ids), "logprobs": list(c.logprobs), "temperature": c.temperature,
              **c.truncation.to_dict()}
    d = diagnose_sample(sample, loader=loader)
    assert not d.divergent, d.format()
    assert d.replay["rollout_matches_sample"] is True
    # the same sample without its truncation: the replays reproduce neither the recorded logprobs nor each other
    plain = {k: v for k, v in sample.items() if k not in ("top_k", "top_p", "min_p")}
    d2 = diagnose_sample(plain, loader=loader, trainer=f"top_k={TRUNC.top_k},top_p={TRUNC.top_p}")
    assert (d2.klass, d2.cause) == ("framework", "truncation"), d2.format()
    assert d2.replay["rollout_matches_sample"] is False
    assert torch.isfinite(torch.tensor(d2.max_abs_logdiff))
