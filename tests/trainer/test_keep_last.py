"""``checkpoint.keep_last``: old checkpoints and weight versions are pruned, atomically, and the one
``latest`` points at is never touched."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from onpolicy.trainer.checkpoint import CheckpointState, load_checkpoint, prune_checkpoints, save_checkpoint
from onpolicy.weights import export_weights, prune_weight_versions


def state(step: int) -> CheckpointState:
    return CheckpointState(step=step, model_name="m", kernel_fingerprint="fp", model={"w": torch.full((4,), step)},
                           optimizer=None, rng={"torch": torch.get_rng_state()}, extra_json=f'{{"step": {step}}}')


def test_prune_keeps_the_newest_checkpoints(tmp_path: Path) -> None:
    for step in (0, 1, 2, 10, 11):
        save_checkpoint(tmp_path, state(step))
    deleted = prune_checkpoints(tmp_path, 2)
    assert [p.name for p in deleted] == ["step-000000", "step-000001", "step-000002"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "step-000010", "step-000011"]
    assert load_checkpoint(tmp_path).step == 11
    assert prune_checkpoints(tmp_path, 2) == []
    with pytest.raises(ValueError):
        prune_checkpoints(tmp_path, 0)


def test_prune_never_deletes_what_latest_points_at(tmp_path: Path) -> None:
    import json

    for step in (1, 2, 3):
        save_checkpoint(tmp_path, state(step))
    pointer = json.loads((tmp_path / "latest").read_text())
    (tmp_path / "latest").write_text(json.dumps({**pointer, "dir": "step-000001"}))  # an older latest
    prune_checkpoints(tmp_path, 1)
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("step")) == ["step-000001", "step-000003"]


def test_prune_cleans_up_an_interrupted_prune(tmp_path: Path) -> None:
    for step in (1, 2):
        save_checkpoint(tmp_path, state(step))
    leftover = tmp_path / ".deleted-step-000000-abcd1234"
    (leftover / "sub").mkdir(parents=True)
    prune_checkpoints(tmp_path, 2)
    assert not leftover.exists()


def test_prune_weight_versions(tmp_path: Path) -> None:
    for v in (1, 2, 3, 12):
        export_weights({"w": torch.ones(2) * v}, tmp_path, v, "fp", "m")
    (tmp_path / "unrelated.txt").write_text("kept")
    deleted = prune_weight_versions(tmp_path, 2)
    assert [p.name for p in deleted] == ["weights-v000001.safetensors", "weights-v000002.safetensors"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["unrelated.txt", "weights-v000003.safetensors",
                                                          "weights-v000012.safetensors"]
