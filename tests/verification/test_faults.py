"""Acceptance tests of the doctor: one injected fault of each class, with the exact classification
and the first divergent layer/operator the evidence shows; a consistent pair reports no divergence."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from doctor_support import FINGERPRINT, PROMPT_IDS, TOKEN_IDS

from onpolicy.verification.doctor import Diagnosis, diagnose
from onpolicy.weights import export_weights


def run(loader: Callable[[str, str], object], model: str = "tiny-qwen3", **kw: object) -> Diagnosis:
    kw.setdefault("prompt_ids", PROMPT_IDS)
    kw.setdefault("token_ids", TOKEN_IDS)
    return diagnose(model, kernel_fingerprint=FINGERPRINT, loader=loader, **kw)  # type: ignore[arg-type]


def assert_first(d: Diagnosis, klass: str, cause: str, op: str, layer: int | None, *, reaches_logprobs: bool = True,
                 ) -> None:
    assert d.divergent, d.format()
    assert (d.klass, d.cause, d.op, d.layer) == (klass, cause, op, layer), d.format()
    if reaches_logprobs:
        assert d.max_abs_logdiff > 0, d.format()


@pytest.mark.parametrize("model", ["tiny-qwen3", "tiny-llama", "tiny-qwen3-moe"])
def test_consistent_pair_reports_no_divergence(loader: Callable[[str, str], object], model: str) -> None:
    d = run(loader, model)
    assert not d.divergent and d.klass == "none" and d.cause is None, d.format()
    assert d.max_abs_logdiff == 0 and d.mismatched_tokens == 0 and d.tokens == len(TOKEN_IDS)
    assert d.op is None and d.layer is None and d.ops_divergent == 0 and d.ops_compared > 0
    out = d.to_dict()
    assert out["class"] == "none" and out["divergent"] is False and out["max_abs_logdiff"] == 0
    assert not any(f["differ"] for f in d.facts.values())


@pytest.mark.parametrize("model", ["tiny-qwen3", "tiny-llama", "tiny-qwen3-moe"])
def test_fast_kernels_in_rollout_are_an_operator_fault(loader: Callable[[str, str], object], model: str) -> None:
    d = run(loader, model, rollout="kernels=fast")
    # the fast backend's RMSNorm is torch's ops; the reference sums the squares in rowdot's order
    # (kernels/cpu/rowwise.c): the very first op of the prefill differs, at the rows whose sums
    # round differently (an ulp there may round away before a tiny random model's token logprobs)
    assert_first(d, "operator", "kernel", "rmsnorm", 0, reaches_logprobs=False)
    assert d.module == "model.layers.0.input_layernorm" and d.phase == "prefill"
    assert 0 <= d.position < len(PROMPT_IDS)
    assert d.differing_inputs == []  # identical inputs ...
    assert d.swap == {"reproducible": True, "rollout_op_on_trainer_inputs": False,  # ... different outputs
                      "trainer_op_on_trainer_inputs": True}
    assert d.backends["rollout"].startswith("fast-") and d.backends["trainer"].startswith("reference-")
    assert d.shapes["rollout"]["x"] == [len(PROMPT_IDS), 64]
    assert d.shapes["trainer"]["x"][0] == len(PROMPT_IDS + TOKEN_IDS) - 1
    assert d.facts["kernel_config"]["differ"]


def test_kv_tile_difference_is_a_kernel_config_fault(loader: Callable[[str, str], object]) -> None:
    d = run(loader, rollout="kv_tile=16", trainer="kv_tile=32")
    # Same operator set with a different constant: attention is the first op whose outputs differ on
    # identical inputs, and the trainer's KV tile reproduces the trainer's bits -> framework/kernel_config.
    assert_first(d, "framework", "kernel_config", "attention", 0)
    assert d.differing_inputs == [] and d.position is not None and d.position >= 16
    assert d.swap["rollout_op_on_trainer_inputs"] is False and d.swap["trainer_op_on_trainer_inputs"] is True
    assert any("kv_tile" in e for e in d.evidence)


def test_bf16_against_fp32_is_a_dtype_fault(loader: Callable[[str, str], object]) -> None:
    d = run(loader, rollout="dtype=bf16")
    assert_first(d, "framework", "dtype", "embedding", None)
    assert d.facts["dtype"] == {"rollout": "bf16", "trainer": "fp32", "differ": True}
    assert not d.facts["weights"]["differ"]  # same weights, another precision


def test_temperature_mismatch_shows_only_at_the_logprobs(loader: Callable[[str, str], object]) -> None:
    d = run(loader, temperature=0.7, trainer="temperature=1.0")
    assert_first(d, "framework", "temperature", "logprobs", None)
    assert d.module == "lm_head" and d.differing_inputs == ["temperature"]
    # every hidden-state operator is bitwise equal: only the log-softmax and the (here inactive)
    # truncation step it feeds differ
    assert d.ops_divergent == 2
    assert d.swap["rollout_op_on_trainer_inputs"] is True


@pytest.fixture
def stale_weights(loader: Callable[[str, str], object], tmp_path: Path) -> tuple[Path, Path]:
    """Two weight versions of tiny-qwen3 (export_weights): all weights perturbed, and only layer 1's
    MLP down projection perturbed."""
    lm = loader("tiny-qwen3", "fp32")
    state = {k: v.clone() for k, v in lm.model.state_dict().items()}  # type: ignore[attr-defined]
    gen = torch.Generator().manual_seed(0)
    all_ = {k: v + 1e-3 * torch.randn(v.shape, generator=gen) for k, v in state.items()}
    one = dict(state)
    one["model.layers.1.mlp.down_proj.weight"] = state["model.layers.1.mlp.down_proj.weight"] * 1.01
    a = export_weights(all_, tmp_path / "all", 6, FINGERPRINT, "tiny-qwen3")
    b = export_weights(one, tmp_path / "one", 7, FINGERPRINT, "tiny-qwen3")
    return Path(a.path), Path(b.path)


def test_stale_weights_are_a_weights_fault(loader: Callable[[str, str], object], stale_weights: tuple[Path, Path],
                                           ) -> None:
    all_, one = stale_weights
    d = run(loader, rollout=f"weights={all_}")
    assert_first(d, "framework", "weights", "embedding", None)
    assert d.differing_inputs == ["weight"] and d.facts["weights"]["differ"]
    assert d.facts["weights"]["rollout_version"] == "6"
    d = run(loader, trainer=f"weights={one}")
    assert_first(d, "framework", "weights", "linear", 1)
    assert d.module == "model.layers.1.mlp.down_proj" and d.differing_inputs == ["weight"]


def test_position_offset_is_a_positions_fault(loader: Callable[[str, str], object]) -> None:
    d = run(loader, trainer="position_offset=1")
    assert_first(d, "framework", "positions", "rope", 0)
    assert d.module == "model.layers.0.self_attn" and d.differing_inputs == ["cos", "sin"] and d.position == 0
    assert d.facts["positions"]["differ"]


def test_off_by_one_mask_is_an_attention_mask_fault(loader: Callable[[str, str], object]) -> None:
    d = run(loader, "tiny-llama", trainer="mask_offset=1")
    assert_first(d, "framework", "attention_mask", "attention", 0)
    assert d.differing_inputs == ["mask"] and d.position == 1  # position 0 still sees itself
    assert d.swap["rollout_op_on_trainer_inputs"] is True  # with the trainer's mask, the trainer's output


def test_different_tokenization_is_a_tokenization_fault(loader: Callable[[str, str], object]) -> None:
    d = run(loader, prompt_ids=None, prompt="Tell me a story.", trainer="tokenizer=raw")
    assert_first(d, "framework", "tokenization", "embedding", None)
    assert d.differing_inputs == ["ids"] and d.facts["tokenization"]["differ"]


def test_chunked_prefill_and_sampled_continuation_stay_consistent(loader: Callable[[str, str], object]) -> None:
    d = run(loader, "tiny-llama", token_ids=None, rollout="max_batched_tokens=5", max_new_tokens=6, seed=3)
    assert not d.divergent and d.tokens == 6 and d.klass == "none", d.format()
