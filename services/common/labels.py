"""Prometheus label values made of what a job spec names: never a server path.

``/metrics`` has no authentication (``docs/reliability.md``), so a model named by a path is
labelled with the path's last component only (``/srv/models/qwen-0.5b`` -> ``qwen-0.5b``); a
registered model name (``tiny-qwen3``) or a Hugging Face id (``Qwen/Qwen2.5-0.5B-Instruct``) is
kept as it is."""

from __future__ import annotations

import os
from pathlib import Path


def is_path(ref: str) -> bool:
    """Whether a model reference is a filesystem path rather than a name or a hub id (``org/name``)."""
    return (ref.startswith(("/", ".", "~")) or ref.count("/") > 1 or "\\" in ref or ref.endswith(".gguf")
            or (os.sep in ref and Path(ref).exists()))


def model_label(ref: str) -> str:
    """The ``model`` label value of a model reference (see the module docstring)."""
    if not is_path(ref):
        return ref
    return Path(ref.rstrip("/\\")).name or "local"
