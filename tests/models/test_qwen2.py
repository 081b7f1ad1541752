"""Qwen2 / Qwen2.5 (``model_type: qwen2``): a bias on q/k/v_proj and none on o_proj, no q/k norm —
and Llama's ``attention_bias: true``, a bias on all four. Both within 1e-4 of transformers; Qwen2
through the fused decoder stack of the rollout, bitwise equal to the trainer; certified by the
selftest and passed by ``onpolicy consistency``. (Logprob/gradient accuracy of ``tiny-qwen2`` is in
``test_hf_accuracy``, its needle and rollout = trainer tests in ``tests/rollout/test_needle.py``.)"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import torch
import transformers
from hf_support import TOL, build_hf, hf_vs_ours

from onpolicy.kernels import KernelConfig, get_backend
from onpolicy.models.causal_lm import CausalLM
from onpolicy.models.registry import load_model
from onpolicy.models.tiny import tiny_checkpoint
from onpolicy.rollout import EngineConfig, RolloutEngine, SamplingParams
from onpolicy.trainer.forward import ScoredSequence, sequence_logprobs

CLI = [sys.executable, "-m", "onpolicy.cli.main"]


def _biases(model: CausalLM) -> dict[str, bool]:
    attn = model.model.layers[0].self_attn
    return {p: getattr(attn, f"{p}_proj").bias is not None for p in "qkvo"}


def test_qwen2_has_qkv_bias_and_no_o_bias_like_transformers() -> None:
    lm = load_model("tiny-qwen2", get_backend(KernelConfig()))
    assert lm.config.family == "qwen2" and not lm.config.qk_norm
    assert _biases(lm.model) == {"q": True, "k": True, "v": True, "o": False}
    hf = transformers.AutoModelForCausalLM.from_pretrained(tiny_checkpoint("tiny-qwen2"), dtype=torch.float32)
    assert set(dict(lm.model.named_parameters())) == set(dict(hf.named_parameters()))
    for name, p in lm.model.named_parameters():
        if name.endswith(".bias"):  # the checkpoint's random biases, not transformers' zero init
            assert torch.equal(p, dict(hf.named_parameters())[name]) and p.abs().sum() > 0, name


def test_llama_attention_bias_is_on_all_four_projections(tmp_path: Path) -> None:
    path = build_hf(tmp_path, "llama", attention_bias=True, head_dim=16)
    lm = load_model(str(path), get_backend(KernelConfig()))
    assert _biases(lm.model) == {"q": True, "k": True, "v": True, "o": True}
    assert hf_vs_ours(path) <= TOL


def test_qwen2_rollout_runs_the_fused_stack_bitwise_equal_to_the_trainer(load_tiny: Callable[..., object]) -> None:
    lm = load_tiny("tiny-qwen2", "bf16")
    stack = lm.model.dense_stack()  # type: ignore[attr-defined]
    assert stack is not None
    assert all(x.q_bias is not None and x.k_bias is not None and x.v_bias is not None and x.o_bias is None
               for x in stack.layers)
    prompts = [[(5 * i + 3 * j) % 310 for j in range(4 + 11 * i)] for i in range(5)]
    comps = RolloutEngine(lm, EngineConfig(max_num_seqs=4, max_batched_tokens=19)).generate(  # type: ignore[arg-type]
        prompts, SamplingParams(temperature=0.9, max_new_tokens=30, n=2, seed=4, ignore_eos=True))
    seqs = [ScoredSequence(c.prompt_ids, c.token_ids, c.temperature) for c in comps]
    with torch.no_grad():
        trainer = sequence_logprobs(lm.model, seqs, pack_tokens=50)  # type: ignore[attr-defined]
    assert len(comps) == 10
    for c, t in zip(comps, trainer, strict=True):
        assert torch.equal(torch.tensor(c.logprobs, dtype=torch.float32), t)


def test_qwen2_biases_change_the_logprobs(load_tiny: Callable[..., object]) -> None:
    """The bias is applied: zeroing it moves the logprobs (so the accuracy tests test it)."""
    model = load_tiny("tiny-qwen2", fresh=True).model  # type: ignore[attr-defined]
    s = ScoredSequence((1, 2, 3), (4, 5, 6, 7))
    with torch.no_grad():
        before = sequence_logprobs(model, [s])[0]
        model.model.layers[0].self_attn.k_proj.bias.zero_()
        after = sequence_logprobs(model, [s])[0]
    assert not torch.equal(before, after)


def test_consistency_command_passes_on_tiny_qwen2() -> None:
    proc = subprocess.run([*CLI, "consistency", "--model", "tiny-qwen2", "--requests", "4", "--max-new-tokens", "16",
                           "--kv-tile", "16", "--json"], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr
    rep = json.loads(proc.stdout)
    assert rep["passed"] and rep["mismatched_tokens"] == 0 and rep["max_abs_logdiff"] == 0.0
    assert rep["tokens_checked"] > 0


def test_consistency_command_passes_on_tiny_qwen2_with_a_tensor_parallel_rollout() -> None:
    """q/k/v biases split with their heads over 2 TP ranks: the rollout still equals the trainer at TP 1."""
    proc = subprocess.run([*CLI, "consistency", "--model", "tiny-qwen2", "--rollout-tp", "2", "--requests", "2",
                           "--max-new-tokens", "8", "--kv-tile", "16", "--json"], capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr
    rep = json.loads(proc.stdout)
    assert rep["rollout_tp"] == 2 and rep["passed"] and rep["mismatched_tokens"] == 0 and rep["tokens_checked"] == 16


def test_selftest_certifies_for_tiny_qwen2_with_the_bias_probe(tmp_home: Path) -> None:
    proc = subprocess.run([*CLI, "selftest", "--model", "tiny-qwen2", "--json"], capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr
    rep = json.loads(proc.stdout)
    assert rep["certified"] and rep["shapes"]["head_dim"] == 16
    bias = [p for p in rep["probes"] if p["name"].startswith("linear+bias/qkv")]
    assert bias and all(p["passed"] and p["checked"] > 0 for p in bias)
