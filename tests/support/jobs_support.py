"""A Hugging Face hub cache laid out in a test directory the way ``huggingface_hub`` writes one
(``models--org--name/{blobs,refs/main,snapshots/<commit>}``), holding a copy of a tiny checkpoint."""

from __future__ import annotations

import hashlib
import os
import shutil
from pathlib import Path


def lay_out_hub_cache(cache: Path, repo_id: str, checkpoint: Path) -> Path:
    """Put ``checkpoint``'s files into ``cache`` as revision ``main`` of model ``repo_id``; returns
    the snapshot directory. Files are blobs named by their sha256, linked from the snapshot."""
    repo = cache / f"models--{repo_id.replace('/', '--')}"
    commit = hashlib.sha1(repo_id.encode()).hexdigest()
    snapshot = repo / "snapshots" / commit
    (repo / "blobs").mkdir(parents=True, exist_ok=True)
    snapshot.mkdir(parents=True, exist_ok=True)
    for f in sorted(checkpoint.iterdir()):
        if not f.is_file():
            continue
        blob = repo / "blobs" / hashlib.sha256(f.read_bytes()).hexdigest()
        if not blob.exists():
            shutil.copyfile(f, blob)
        link = snapshot / f.name
        if not link.exists():
            os.symlink(os.path.relpath(blob, snapshot), link)
    (repo / "refs").mkdir(exist_ok=True)
    (repo / "refs" / "main").write_text(commit)
    return snapshot
