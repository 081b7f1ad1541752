"""A tiny checkpoint built by a peer rank (a process already in a gloo world, rank != 0) is complete:
transformers' ``save_pretrained`` writes nothing there by default, which once left a cold cache with
a model directory holding only the tokenizer."""

from __future__ import annotations

import os
from pathlib import Path

from onpolicy.models import tiny
from onpolicy.parallel.launch import run_workers


def _build_here(rank: int, world: int, root: str) -> list[str]:
    dest = Path(root) / f"rank{rank}"
    dest.mkdir()
    tiny._build("tiny-qwen3", dest)
    return sorted(os.listdir(dest))


def test_peer_rank_writes_the_weights(tmp_path: Path) -> None:
    listings = run_workers(_build_here, 2, str(tmp_path))
    for files in listings:
        assert {"config.json", "model.safetensors", "tokenizer.json"} <= set(files)
