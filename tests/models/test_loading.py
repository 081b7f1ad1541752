"""HF checkpoint directories: sharded safetensors with an index, and clear errors on bad ones."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from onpolicy.kernels import KernelConfig, get_backend
from onpolicy.models.loading import ModelLoadError
from onpolicy.models.registry import load_model
from onpolicy.models.tiny import tiny_checkpoint


@pytest.fixture(scope="module")
def sharded(tmp_path_factory) -> Path:
    import transformers

    src = tiny_checkpoint("tiny-llama")
    out = tmp_path_factory.mktemp("sharded")
    model = transformers.AutoModelForCausalLM.from_pretrained(src)
    model.save_pretrained(out, max_shard_size="60KB")
    return out


def test_sharded_checkpoint_loads_the_same_weights(sharded: Path) -> None:
    index = json.loads((sharded / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    ops = get_backend(KernelConfig())
    a, b = load_model("tiny-llama", ops), load_model(str(sharded), ops)
    assert a.weights_sha256 == b.weights_sha256
    for (na, pa), (nb, pb) in zip(a.model.state_dict().items(), b.model.state_dict().items(), strict=True):
        assert na == nb and torch.equal(pa, pb)
    assert b.tokenizer is None  # no tokenizer files: token-id commands still work


def test_missing_shard_is_a_clear_error(sharded: Path, tmp_path: Path) -> None:
    broken = tmp_path / "broken"
    shutil.copytree(sharded, broken)
    shard = sorted(broken.glob("model-*.safetensors"))[0]
    shard.unlink()
    with pytest.raises(ModelLoadError, match="missing shard"):
        load_model(str(broken), get_backend(KernelConfig()))


def test_config_and_weights_must_match(tmp_path: Path) -> None:
    src = tiny_checkpoint("tiny-qwen3")
    bad = tmp_path / "bad"
    shutil.copytree(src, bad)
    cfg = json.loads((bad / "config.json").read_text())
    cfg["hidden_size"] = 96
    (bad / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelLoadError, match=r"shape|missing"):
        load_model(str(bad), get_backend(KernelConfig()))
    (bad / "config.json").write_text("{}")
    with pytest.raises(ValueError, match="model_type"):
        load_model(str(bad), get_backend(KernelConfig()))
    (bad / "config.json").write_text('{"model_type": "llama", "hidden_size": 64}')
    with pytest.raises(ValueError, match=r"missing field '(num_attention_heads|vocab_size)'"):
        load_model(str(bad), get_backend(KernelConfig()))
