"""Model loading: HF directories (config.json + safetensors, sharded index) and GGUF files, into a
``CausalLM`` on a given backend, plus the weight checksum every service reports and in-place weight
updates (a sharded model's, ``onpolicy.parallel.parallelize``, take its shard of the full state)."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

import tokenizers
import torch
from safetensors.torch import load_file
from torch import Tensor

from onpolicy.kernels import Backend

from .causal_lm import CausalLM, resolve_tied_head
from .chat_template import ChatTemplateError, read_chat_template, read_tokenizer_config, special_tokens
from .config import ModelConfig, read_config_json
from .sharding import shard_state_dict
from .tokenizer import Tokenizer


class ModelLoadError(ValueError):
    """A checkpoint is missing, unreadable or does not match its config."""


@dataclass
class LoadedModel:
    name: str
    model: CausalLM
    tokenizer: Tokenizer | None
    weights_sha256: str

    @property
    def config(self) -> ModelConfig:
        return self.model.config

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        ids = set(self.config.eos_token_ids)
        if self.tokenizer is not None:
            ids.update(self.tokenizer.eos_token_ids)
        return tuple(sorted(ids))


def weights_sha256(tensors: dict[str, Tensor]) -> str:
    """sha256 over (name, dtype, shape, bytes) of every tensor, in name order."""
    h = hashlib.sha256()
    for name in sorted(tensors):
        t = tensors[name].detach().contiguous().cpu()
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()


def read_hf_dir(path: Path) -> tuple[dict, dict[str, Tensor]]:
    cfg_file = path / "config.json"
    if not cfg_file.is_file():
        raise ModelLoadError(f"{path}: no config.json")
    try:
        config = read_config_json(cfg_file)
    except ValueError as e:
        raise ModelLoadError(str(e)) from None
    index = path / "model.safetensors.index.json"
    if index.is_file():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        files = [path / s for s in shards]
    else:
        files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"{path}: no *.safetensors weights")
    tensors: dict[str, Tensor] = {}
    for f in files:
        if not f.is_file():
            raise ModelLoadError(f"{path}: missing shard {f.name}")
        tensors.update(load_file(str(f)))
    return config, tensors


def read_hf_tokenizer(path: Path, config: dict) -> Tokenizer | None:
    """The tokenizer of an HF directory (``tokenizer.json``), with its chat template
    (``chat_template.jinja`` or ``tokenizer_config.json``) and special tokens; None without one."""
    tok_file = path / "tokenizer.json"
    if not tok_file.is_file():
        return None
    try:
        inner = tokenizers.Tokenizer.from_file(str(tok_file))
        tcfg = read_tokenizer_config(path)
        template = read_chat_template(path, tcfg)
    except ChatTemplateError as e:
        raise ModelLoadError(str(e)) from None
    except Exception as e:  # tokenizers raises a bare Exception for a malformed tokenizer.json
        raise ModelLoadError(f"{tok_file}: not a readable tokenizer ({str(e).splitlines()[0]})") from None
    specials = special_tokens(tcfg)
    eos_tok = specials.get("eos_token")
    eos = (inner.token_to_id(eos_tok),) if eos_tok is not None and inner.token_to_id(eos_tok) is not None else ()
    return Tokenizer(inner, template, eos, specials)


def build_model(config: dict, tensors: dict[str, Tensor], ops: Backend, source: str) -> CausalLM:
    """A ``CausalLM`` from full HF-named tensors."""
    cfg = resolve_tied_head(ModelConfig.from_hf(config), tensors)
    with torch.device("meta"):
        model = CausalLM(cfg, ops)
    expected = dict(model.named_parameters())
    tensors = {k: v for k, v in tensors.items() if not k.endswith("rotary_emb.inv_freq")}
    if cfg.tie_word_embeddings:
        tensors.pop("lm_head.weight", None)
    missing = sorted(set(expected) - set(tensors))
    unexpected = sorted(set(tensors) - set(expected))
    if missing or unexpected:
        raise ModelLoadError(f"{source}: weights do not match the {cfg.family} config "
                              f"(missing {missing[:3]}{'…' if len(missing) > 3 else ''}, "
                              f"unexpected {unexpected[:3]}{'…' if len(unexpected) > 3 else ''})")
    for name, param in expected.items():
        t = tensors[name]
        if tuple(t.shape) != tuple(param.shape):
            raise ModelLoadError(f"{source}: {name} has shape {tuple(t.shape)}, config implies {tuple(param.shape)}")
    state = {k: tensors[k].to(ops.config.dtype) for k in expected}
    model.load_state_dict(state, assign=True)
    model.requires_grad_(False)
    return model


def copy_weights_(model: CausalLM, state: dict[str, Tensor]) -> None:
    """Copy ``state`` into ``model``'s parameters in place (cast to their dtype) after checking that
    every parameter is present with its shape; on error nothing has been changed. A sharded model
    takes the full state and keeps its own shard."""
    state = shard_state_dict(state, model.config, model.parallel)
    params = dict(model.named_parameters())
    missing = sorted(set(params) - set(state))
    if missing:
        raise ModelLoadError(f"weight update is missing {missing[:3]}{'…' if len(missing) > 3 else ''}")
    for name, p in params.items():
        if tuple(state[name].shape) != tuple(p.shape):
            raise ModelLoadError(f"weight update: {name} has shape {tuple(state[name].shape)}, "
                                  f"expected {tuple(p.shape)}")
    with torch.no_grad():
        for name, p in params.items():
            p.copy_(state[name].to(p.dtype))
