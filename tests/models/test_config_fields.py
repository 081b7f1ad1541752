"""The fields real checkpoints' ``config.json`` carry: each is read as transformers reads it, or
refused with a one-line ``ValueError`` naming it — never silently wrong.

Config-level checks compare ``ModelConfig.from_hf`` with transformers' own config classes; where a
field changes the numbers (RoPE scaling, ``head_dim``, tied heads) a tiny checkpoint built here is
compared with transformers' model within 1e-4, and rolled out on our engine bitwise equal to the
trainer."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers
from hf_support import BASE, TOL, build_hf, hf_vs_ours, rollout_equals_trainer
from safetensors.torch import load_file, save_file

from onpolicy.kernels import KernelConfig, get_backend
from onpolicy.models.causal_lm import rope_table
from onpolicy.models.config import ModelConfig
from onpolicy.models.registry import load_model
from onpolicy.models.tiny import HF_CLASSES, tiny_checkpoint


def cfg_dict(model_type: str, **over: Any) -> dict[str, Any]:
    return {"model_type": model_type, **BASE, **over}


def refused(cfg: dict[str, Any], field: str) -> str:
    """The message of ``from_hf``'s refusal of ``cfg``, checked to be one line naming ``field``."""
    with pytest.raises(ValueError) as e:
        ModelConfig.from_hf(cfg)
    msg = str(e.value)
    assert "\n" not in msg and field in msg, msg
    return msg


# ------------------------------------------------------------------------------------ defaults


@pytest.mark.parametrize("model_type", list(HF_CLASSES))
def test_omitted_fields_take_transformers_defaults(model_type: str) -> None:
    # 32 heads: Qwen2/Qwen3 default to 32 KV heads, Qwen3-MoE to 4
    minimal = {k: v for k, v in cfg_dict(model_type, hidden_size=256, num_attention_heads=32).items()
               if k != "num_key_value_heads"}
    if model_type == "qwen3_moe":
        minimal.update(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32)
    ours = ModelConfig.from_hf(minimal)
    theirs = getattr(transformers, f"{HF_CLASSES[model_type]}Config")(
        **{k: v for k, v in minimal.items() if k != "model_type"})
    assert ours.head_dim == (getattr(theirs, "head_dim", None) or theirs.hidden_size // theirs.num_attention_heads)
    assert ours.num_kv_heads == theirs.num_key_value_heads
    assert ours.max_position_embeddings == theirs.max_position_embeddings
    assert ours.tie_word_embeddings is theirs.tie_word_embeddings is False
    assert ours.rope_theta == theirs.rope_parameters["rope_theta"]
    assert ours.rms_norm_eps == theirs.rms_norm_eps
    if model_type == "qwen3_moe":
        assert ours.norm_topk_prob is theirs.norm_topk_prob is False


def test_qwen3_without_head_dim_is_128_as_in_transformers() -> None:
    # Qwen3-0.6B: hidden 1024, 16 heads (64 each), head_dim 128
    cfg = cfg_dict("qwen3", hidden_size=1024, num_attention_heads=16, num_key_value_heads=8)
    assert ModelConfig.from_hf(cfg).head_dim == 128 == transformers.Qwen3Config(**BASE).head_dim
    assert ModelConfig.from_hf({**cfg, "head_dim": 128}).head_dim == 128
    assert ModelConfig.from_hf({**cfg, "head_dim": None}).head_dim == 64
    assert ModelConfig.from_hf(cfg_dict("qwen2", hidden_size=1024, num_attention_heads=16)).head_dim == 64


# ------------------------------------------------------------------------------ tied LM head


def test_tied_checkpoint_with_and_without_lm_head_weight(tmp_path: Path) -> None:
    src = tiny_checkpoint("tiny-qwen3")  # tie_word_embeddings: true, no lm_head.weight
    assert "lm_head.weight" not in load_file(str(src / "model.safetensors"))
    ops = get_backend(KernelConfig())
    plain = load_model(str(src), ops)
    with_head = tmp_path / "with-head"
    shutil.copytree(src, with_head)
    tensors = load_file(str(with_head / "model.safetensors"))
    tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"].clone()
    save_file(tensors, str(with_head / "model.safetensors"), metadata={"format": "pt"})
    same = load_model(str(with_head), ops)
    assert plain.model.lm_head is None and same.model.lm_head is None
    assert same.config.tie_word_embeddings and same.weights_sha256 == plain.weights_sha256
    assert torch.equal(same.model.lm_head_fp32(), plain.model.model.embed_tokens.weight.float())


def test_tied_config_with_a_different_lm_head_keeps_it_as_transformers_does(tmp_path: Path) -> None:
    path = tmp_path / "untied"
    shutil.copytree(tiny_checkpoint("tiny-qwen2"), path)
    tensors = load_file(str(path / "model.safetensors"))
    head = torch.randn(tensors["model.embed_tokens.weight"].shape, generator=torch.Generator().manual_seed(3))
    tensors["lm_head.weight"] = head
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    lm = load_model(str(path), get_backend(KernelConfig()))
    assert not lm.config.tie_word_embeddings and lm.model.lm_head is not None
    assert torch.equal(lm.model.lm_head.weight, head)
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    assert torch.equal(hf.lm_head.weight, head)  # transformers does not tie them either
    assert hf_vs_ours(path, (40,)) <= TOL


# --------------------------------------------------------------------------------------- RoPE


@pytest.mark.parametrize("rope", [
    {"rope_scaling": None},
    {"rope_scaling": {"rope_type": "default"}},
    {"rope_scaling": {"type": "default"}},
    {"rope_parameters": {"rope_type": "default", "rope_theta": 500000.0}},
    {"rope_parameters": None, "rope_theta": 500000.0},
])
def test_default_rope_spellings_pass(rope: dict[str, Any]) -> None:
    cfg = ModelConfig.from_hf(cfg_dict("llama", **rope))
    assert cfg.rope_scaling.rope_type == "default"
    theirs = transformers.LlamaConfig(**{k: v for k, v in cfg_dict("llama", **rope).items() if k != "model_type"})
    assert cfg.rope_theta == theirs.rope_parameters["rope_theta"]


def test_rope_theta_inside_rope_parameters_wins_as_in_transformers() -> None:
    raw = cfg_dict("qwen2", rope_theta=10.0, rope_parameters={"rope_type": "default", "rope_theta": 1e6})
    theirs = transformers.Qwen2Config(**{k: v for k, v in raw.items() if k != "model_type"})
    assert ModelConfig.from_hf(raw).rope_theta == theirs.rope_parameters["rope_theta"] == 1e6


@pytest.mark.parametrize("kind", ["yarn", "dynamic", "longrope", "proportional", "su"])
def test_unsupported_rope_types_are_refused(kind: str) -> None:
    msg = refused(cfg_dict("qwen2", rope_scaling={"rope_type": kind, "factor": 4.0}), "rope_scaling.rope_type")
    assert repr(kind) in msg and "llama3" in msg
    refused(cfg_dict("qwen3", rope_parameters={"rope_type": kind, "factor": 4.0}), "rope_parameters.rope_type")


def test_partial_rotary_and_per_layer_rope_are_refused() -> None:
    refused(cfg_dict("llama", partial_rotary_factor=0.5), "partial_rotary_factor")
    refused(cfg_dict("llama", rope_parameters={"rope_type": "default", "partial_rotary_factor": 0.25}),
            "partial_rotary_factor")
    assert ModelConfig.from_hf(cfg_dict("llama", partial_rotary_factor=1.0)).rope_scaling.rope_type == "default"
    refused(cfg_dict("llama", rope_parameters={"full_attention": {"rope_type": "default"}}), "rope_parameters")
    refused(cfg_dict("llama", rope_scaling={"rope_type": "llama3", "factor": 8.0}), "low_freq_factor")


LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 32}


@pytest.mark.parametrize("scaling", [{"rope_type": "linear", "factor": 4.0}, LLAMA3], ids=["linear", "llama3"])
def test_scaled_rope_matches_transformers(tmp_path: Path, scaling: dict[str, Any]) -> None:
    path = build_hf(tmp_path, "llama", rope_scaling=dict(scaling), head_dim=16)
    cfg = load_model(str(path), get_backend(KernelConfig())).config
    assert cfg.rope_scaling.rope_type == scaling["rope_type"]
    scaled = rope_table(cfg.head_dim, cfg.rope_theta, 64, cfg.rope_scaling)[0]
    assert not torch.equal(scaled, rope_table(cfg.head_dim, cfg.rope_theta, 64)[0])  # the scaling matters
    assert hf_vs_ours(path) <= TOL
    rollout_equals_trainer(path)


# ------------------------------------------------------------------------------------ head_dim


def test_head_dim_unlike_hidden_over_heads_end_to_end(tmp_path: Path) -> None:
    path = build_hf(tmp_path, "qwen3", head_dim=32)  # hidden 64 / 4 heads = 16, as Qwen3-0.6B's 64 vs 128
    lm = load_model(str(path), get_backend(KernelConfig()))
    attn = lm.model.model.layers[0].self_attn
    assert lm.config.head_dim == attn.head_dim == 32
    assert tuple(attn.q_proj.weight.shape) == (4 * 32, 64) and tuple(attn.o_proj.weight.shape) == (64, 4 * 32)
    assert tuple(lm.model.rope_cos.shape[1:]) == (32,)
    assert hf_vs_ours(path) <= TOL
    rollout_equals_trainer(path)


# ------------------------------------------------------------------------------ sliding window


def test_sliding_window_off_is_ignored() -> None:
    cfg = cfg_dict("qwen2", use_sliding_window=False, sliding_window=8, max_window_layers=0)
    assert ModelConfig.from_hf(cfg).family == "qwen2"
    theirs = transformers.Qwen2Config(**{k: v for k, v in cfg.items() if k != "model_type"})
    assert set(theirs.layer_types) == {"full_attention"}


@pytest.mark.parametrize("model_type", ["qwen2", "qwen3", "qwen3_moe"])
def test_sliding_window_on_is_refused(model_type: str) -> None:
    extra = dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32) if model_type == "qwen3_moe" else {}
    msg = refused(cfg_dict(model_type, use_sliding_window=True, sliding_window=64, max_window_layers=1,
                           max_position_embeddings=4096, **extra), "use_sliding_window")
    assert "64-token window" in msg


def test_sliding_window_that_changes_nothing_passes() -> None:
    # no layer at or past max_window_layers: transformers makes every layer full attention
    cfg = cfg_dict("qwen2", use_sliding_window=True, sliding_window=64, max_window_layers=2)
    theirs = transformers.Qwen2Config(**{k: v for k, v in cfg.items() if k != "model_type"})
    assert set(theirs.layer_types) == {"full_attention"}
    assert ModelConfig.from_hf(cfg).family == "qwen2"
    # a window as long as the positions masks nothing
    ModelConfig.from_hf(cfg_dict("qwen2", use_sliding_window=True, sliding_window=4096, max_window_layers=0,
                                 max_position_embeddings=4096))


def test_layer_types_are_checked() -> None:
    refused(cfg_dict("qwen3", layer_types=["full_attention", "linear_attention"]), "layer_types")
    refused(cfg_dict("qwen3", use_sliding_window=True, sliding_window=16, max_position_embeddings=4096,
                     layer_types=["full_attention", "sliding_attention"]), "use_sliding_window")
    assert ModelConfig.from_hf(cfg_dict("qwen3", layer_types=["full_attention"] * 2)).family == "qwen3"


# ------------------------------------------------------------------------------ everything else


def test_activation_other_than_silu_is_refused() -> None:
    refused(cfg_dict("llama", hidden_act="gelu"), "hidden_act")
    refused(cfg_dict("qwen2", hidden_act="relu"), "hidden_act")
    for act in ("silu", "swish"):
        assert ModelConfig.from_hf(cfg_dict("qwen3", hidden_act=act)).family == "qwen3"


def test_mlp_bias_is_refused() -> None:
    refused(cfg_dict("llama", mlp_bias=True), "mlp_bias")
    assert ModelConfig.from_hf(cfg_dict("llama", mlp_bias=False)).family == "llama"


def test_quantized_checkpoints_are_refused() -> None:
    msg = refused(cfg_dict("qwen2", quantization_config={"quant_method": "awq", "bits": 4}), "quantization_config")
    assert "awq" in msg


def test_training_only_fields_do_not_change_the_model() -> None:
    """Dropout is never applied (every forward is the eval-mode one the rollout computes);
    ``pretraining_tp`` is not read by transformers 5's Llama either."""
    base = ModelConfig.from_hf(cfg_dict("llama"))
    assert ModelConfig.from_hf(cfg_dict("llama", attention_dropout=0.1, pretraining_tp=2)) == base
    assert ModelConfig.from_hf(cfg_dict("qwen2", attention_dropout=0.1)) == ModelConfig.from_hf(cfg_dict("qwen2"))


def test_refusal_through_the_loader_and_the_cli_names_the_field(tmp_path: Path) -> None:
    path = tmp_path / "yarn"
    shutil.copytree(tiny_checkpoint("tiny-qwen2"), path)
    cfg = json.loads((path / "config.json").read_text())
    cfg["rope_scaling"] = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 512}
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=r"rope_scaling\.rope_type 'yarn' is not supported"):
        load_model(str(path), get_backend(KernelConfig()))
    proc = subprocess.run([sys.executable, "-m", "onpolicy.cli.main", "generate", "--model", str(path),
                           "--prompt", "hi", "--max-new-tokens", "2"], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1 and "rope_scaling.rope_type 'yarn'" in proc.stderr
