"""HF directories of model references, for engines that read only that format (vLLM).

``hf_directory(ref)`` is the directory itself for an HF directory, the cached tiny checkpoint for a
``tiny-*`` name, and for ``smollm2`` or a ``.gguf`` file an export made once with our own GGUF reader
(``config.json`` + fp32 ``model.safetensors`` of the dequantized tensors + ``tokenizer.json``), cached
under ``$ONPOLICY_HOME/models`` by the GGUF file's size and mtime. The export is written to a
temporary directory that is renamed into place, so a crash leaves no half-written model.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from .checkpoint import CheckpointError
from .tiny import SPECS, build_model_dir, home, tiny_checkpoint


def _gguf_export(gguf: Path) -> Path:
    from safetensors.torch import save_file

    from .gguf import read_gguf

    stat = gguf.stat()
    key = hashlib.sha256(f"{gguf.resolve()}:{stat.st_size}:{stat.st_mtime_ns}".encode()).hexdigest()[:12]
    dest = home() / "models" / f"{gguf.stem}-hf-{key}"
    if (dest / "config.json").is_file():
        return dest
    ckpt = read_gguf(gguf)

    def write(tmp: Path) -> None:
        config = {"architectures": ["LlamaForCausalLM"], "torch_dtype": "float32", **ckpt.config}
        save_file({k: v.contiguous() for k, v in ckpt.tensors.items()}, str(tmp / "model.safetensors"),
                  metadata={"format": "pt"})
        ckpt.tokenizer.save(str(tmp / "tokenizer.json"))
        (tmp / "config.json").write_text(json.dumps(config, indent=1))

    return build_model_dir(dest, write)


def hf_directory(ref: str) -> Path:
    """The HF checkpoint directory (``config.json`` + safetensors) of model reference ``ref``."""
    if ref in SPECS:
        return tiny_checkpoint(ref)
    if ref == "smollm2":
        from .gguf import smollm2_gguf_path

        return _gguf_export(smollm2_gguf_path())
    path = Path(ref)
    if path.is_file() and path.suffix == ".gguf":
        return _gguf_export(path)
    if not (path.is_dir() and (path / "config.json").is_file()):
        raise CheckpointError(f"{ref!r} is not a model: give smollm2, a tiny-* name, a .gguf file or an HF "
                              "directory with config.json")
    return path
