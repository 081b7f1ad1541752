"""Models named by Hugging Face id resolve in the local HF cache, offline, exactly as a user who ran
transformers has them; a missing one is one line saying where we looked."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from jobs_support import lay_out_hub_cache

from onpolicy.kernels import KernelConfig, get_backend
from onpolicy.models.loading import ModelLoadError
from onpolicy.models.registry import load_model
from onpolicy.models.resolve import hub_cache_dir, resolve_model
from onpolicy.models.tiny import tiny_checkpoint


@pytest.fixture
def hub(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    cache = tmp_path / "hf" / "hub"
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    lay_out_hub_cache(cache, "tinyorg/tiny-qwen3", tiny_checkpoint("tiny-qwen3"))
    return cache


def test_a_model_id_resolves_in_the_hf_cache_and_loads(hub: Path) -> None:
    assert hub_cache_dir() == hub
    path = resolve_model("tinyorg/tiny-qwen3")
    assert path.parent.parent == hub / "models--tinyorg--tiny-qwen3"
    ops = get_backend(KernelConfig())
    by_id, builtin = load_model("tinyorg/tiny-qwen3", ops), load_model("tiny-qwen3", ops)
    assert by_id.weights_sha256 == builtin.weights_sha256
    theirs = builtin.model.state_dict()
    assert all(torch.equal(t, theirs[k]) for k, t in by_id.model.state_dict().items())
    assert by_id.tokenizer is not None and by_id.tokenizer.chat_template == builtin.tokenizer.chat_template


def test_hf_hub_cache_overrides_hf_home(tmp_path: Path, hub: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    other = tmp_path / "elsewhere"
    monkeypatch.setenv("HF_HUB_CACHE", str(other))
    assert hub_cache_dir() == other
    with pytest.raises(ModelLoadError, match=str(other)):
        resolve_model("tinyorg/tiny-qwen3")
    lay_out_hub_cache(other, "tinyorg/tiny-qwen3", tiny_checkpoint("tiny-qwen3"))
    assert resolve_model("tinyorg/tiny-qwen3").is_relative_to(other)


def test_a_missing_model_says_where_it_looked(hub: Path) -> None:
    with pytest.raises(ModelLoadError) as e:
        resolve_model("Qwen/Qwen3-0.6B")
    message = str(e.value)
    assert "\n" not in message and str(hub) in message and "offline" in message and "hf download" in message
    with pytest.raises(ModelLoadError, match="unknown model"):
        resolve_model("no such thing")


def test_a_revision_other_than_the_cached_one_is_not_found(hub: Path) -> None:
    assert resolve_model("tinyorg/tiny-qwen3@main").is_dir()
    with pytest.raises(ModelLoadError, match="not in the Hugging Face cache"):
        resolve_model("tinyorg/tiny-qwen3@v2")
