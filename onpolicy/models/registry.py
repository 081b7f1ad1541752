"""``load_model``: a model reference (``onpolicy.models.resolve``) turned into a ``LoadedModel`` on a
backend, and ``load_tokenizer``: only its tokenizer (for preparing prompts without the weights)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from onpolicy.kernels import Backend

from .loading import LoadedModel, build_model, read_hf_dir, read_hf_tokenizer, weights_sha256
from .resolve import BUILTIN_MODELS, resolve_model
from .tokenizer import Tokenizer

if TYPE_CHECKING:
    from .gguf import GGUFCheckpoint, GGUFTokenizer

__all__ = ["BUILTIN_MODELS", "load_model", "load_tokenizer"]

#: GGUF special-token roles -> the names transformers gives them (and passes to chat templates).
_GGUF_SPECIALS = {"bos": "bos_token", "eos": "eos_token", "unk": "unk_token", "pad": "pad_token",
                  "sep": "sep_token", "cls": "cls_token", "mask": "mask_token"}


def gguf_tokenizer(ckpt: GGUFCheckpoint | GGUFTokenizer) -> Tokenizer:
    """Our ``Tokenizer`` of a GGUF file's tokenizer, chat template and special tokens."""
    eos = tuple(v for k, v in ckpt.special_tokens.items() if k == "eos")
    specials = {_GGUF_SPECIALS[role]: ckpt.tokenizer.id_to_token(i) for role, i in ckpt.special_tokens.items()
                if role in _GGUF_SPECIALS and ckpt.tokenizer.id_to_token(i) is not None}
    return Tokenizer(ckpt.tokenizer, ckpt.chat_template, eos, specials)


def _load_gguf(path: Path, ops: Backend, name: str) -> LoadedModel:
    from .gguf import read_gguf

    ckpt = read_gguf(path)
    model = build_model(ckpt.config, ckpt.tensors, ops, str(path))
    return LoadedModel(name, model, gguf_tokenizer(ckpt), weights_sha256(model.state_dict()))


def load_model(ref: str, ops: Backend) -> LoadedModel:
    """Load model reference ``ref`` with its weights in ``ops.config``'s compute dtype."""
    path = resolve_model(ref)
    if path.is_file():
        return _load_gguf(path, ops, ref)
    config, tensors = read_hf_dir(path)
    model = build_model(config, tensors, ops, str(path))
    return LoadedModel(ref, model, read_hf_tokenizer(path, config), weights_sha256(model.state_dict()))


def load_tokenizer(ref: str) -> Tokenizer | None:
    """The tokenizer (with chat template and special tokens) of model reference ``ref``."""
    path = resolve_model(ref)
    if path.is_file():
        from .gguf import read_gguf_tokenizer

        return gguf_tokenizer(read_gguf_tokenizer(path))
    return read_hf_tokenizer(path, {})
