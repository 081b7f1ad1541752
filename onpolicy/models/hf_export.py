"""HF directories of model references, for engines that read only that format (vLLM).

``hf_directory(ref)`` is the directory the reference resolves to (``onpolicy.models.resolve``: an HF
directory, a tiny checkpoint, a model in the Hugging Face cache), and for ``smollm2`` or a ``.gguf``
file an export made once with our own GGUF reader
(``config.json`` + fp32 ``model.safetensors`` of the dequantized tensors + ``tokenizer.json``), cached
under ``$ONPOLICY_HOME/models`` by the GGUF file's size and mtime. The export is written to a
temporary directory that is renamed into place, so a crash leaves no half-written model.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

from torch import Tensor

from .resolve import resolve_model
from .tiny import build_model_dir, home
from .tokenizer import Tokenizer

#: Bumped when what an export writes changes (the cached exports are then rebuilt).
FORMAT = 2


def write_hf_files(dest: Path, config: dict[str, Any], tensors: dict[str, Tensor], tokenizer: Tokenizer | None) -> None:
    """Write an HF checkpoint into the (new, empty) directory ``dest``: ``config.json``,
    ``model.safetensors``, and with a tokenizer ``tokenizer.json``, ``tokenizer_config.json`` (its
    special tokens) and ``chat_template.jinja`` (where it has a template)."""
    from safetensors.torch import save_file

    save_file({k: v.detach().contiguous().cpu() for k, v in tensors.items()}, str(dest / "model.safetensors"),
              metadata={"format": "pt"})
    (dest / "config.json").write_text(json.dumps(config, indent=1))
    if tokenizer is None:
        return
    tokenizer.inner.save(str(dest / "tokenizer.json"))
    (dest / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "PreTrainedTokenizerFast", **tokenizer.special_tokens}, indent=1))
    if tokenizer.chat_template:
        (dest / "chat_template.jinja").write_text(tokenizer.chat_template)


def _gguf_export(gguf: Path) -> Path:
    from .gguf import read_gguf
    from .registry import gguf_tokenizer

    stat = gguf.stat()
    key = hashlib.sha256(f"{gguf.resolve()}:{stat.st_size}:{stat.st_mtime_ns}:{FORMAT}".encode()).hexdigest()[:12]
    dest = home() / "models" / f"{gguf.stem}-hf-{key}"
    if (dest / "config.json").is_file():
        return dest
    ckpt = read_gguf(gguf)
    config = {"architectures": ["LlamaForCausalLM"], "torch_dtype": "float32", **ckpt.config}
    return build_model_dir(dest, lambda tmp: write_hf_files(tmp, config, ckpt.tensors, gguf_tokenizer(ckpt)))


def hf_directory(ref: str) -> Path:
    """The HF checkpoint directory (``config.json`` + safetensors) of model reference ``ref``."""
    path = resolve_model(ref)
    return _gguf_export(path) if path.is_file() else path


#: Files of a base model's HF directory carried into an export as they are.
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "special_tokens_map.json",
                    "generation_config.json")
_DTYPES = {"torch.float32": "float32", "torch.bfloat16": "bfloat16", "torch.float16": "float16"}


def export_trained(tensors: dict[str, Tensor], base_ref: str, out: Path) -> Path:
    """An HF directory at ``out`` (which must not exist) holding ``tensors`` (a trained model's
    HF-named state) with the base model's config, tokenizer and chat template: what transformers'
    ``from_pretrained`` and vLLM load. Written into a temporary directory renamed into place."""
    import shutil

    if out.exists():
        raise FileExistsError(f"{out} already exists (give a new directory)")
    base = hf_directory(base_ref)
    config = json.loads((base / "config.json").read_text())
    dtypes = {_DTYPES.get(str(t.dtype), str(t.dtype)) for t in tensors.values()}
    if len(dtypes) == 1:
        config["torch_dtype"] = config["dtype"] = dtypes.pop()

    def write(tmp: Path) -> None:
        write_hf_files(tmp, config, tensors, None)
        for name in _TOKENIZER_FILES:
            if (base / name).is_file():
                shutil.copyfile(base / name, tmp / name)

    out.parent.mkdir(parents=True, exist_ok=True)
    return build_model_dir(out, write)
