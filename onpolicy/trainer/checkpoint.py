"""Atomic, verified trainer checkpoints on local or shared disk (never sent over the network).

Layout under a checkpoint root::

    latest                      {"dir": "step-000007", "manifest_sha256": "…"}  (atomic replace)
    step-000007/
        model.safetensors       trainable weights in the compute dtype
        reference.safetensors   the frozen KL reference policy (only when the engine has one)
        optimizer.pt            torch.save of the AdamW state_dict (absent before the first step)
        rng.pt                  torch / python / engine RNG states
        extra.json              the caller's opaque JSON (the controller's data cursor)
        manifest.json           step, model, kernel fingerprint, sha256 of every file above

A save writes every file (fsync'd) into a fresh temporary directory ``.step-000007.tmp-…``, renames
it to ``step-000007`` and only then replaces ``latest``. A crash at any point leaves the previous
``latest`` and its directory untouched. Loading reads every file once, checks its sha256 against
the manifest (and the manifest's against ``latest``) and parses the verified bytes; any mismatch is
a ``CheckpointError`` — there is no silent fallback to an older checkpoint. Checkpoints are
private: the root and step directories are made 0700, every file 0600.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import re
import shutil
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save
from torch import Tensor

from onpolicy.weights import atomic_write_bytes, private_dirs

FORMAT = 1
LATEST = "latest"
MANIFEST = "manifest.json"
FILES = ("model.safetensors", "reference.safetensors", "optimizer.pt", "rng.pt", "extra.json")
_STEP_DIR = re.compile(r"^step-(\d{6,})$")


class CheckpointError(RuntimeError):
    """A checkpoint is missing, corrupt, or does not fit the engine restoring it."""


@dataclass
class CheckpointState:
    step: int
    model_name: str
    kernel_fingerprint: str
    model: dict[str, Tensor]
    optimizer: dict[str, Any] | None
    rng: dict[str, Any]
    extra_json: str = "{}"
    reference: dict[str, Tensor] | None = None
    path: Path | None = None
    """The step directory it was loaded from (set by ``load_checkpoint``)."""


def step_dir_name(step: int) -> str:
    return f"step-{step:06d}"


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write(path: Path, data: bytes) -> str:
    with os.fdopen(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    return hashlib.sha256(data).hexdigest()


def _torch_bytes(obj: object) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def _encode(state: CheckpointState) -> dict[str, bytes]:
    try:
        json.loads(state.extra_json)
    except ValueError as e:
        raise CheckpointError(f"extra_json is not valid JSON: {e}") from None
    meta = {"step": str(state.step), "model": state.model_name, "kernel_fingerprint": state.kernel_fingerprint}
    files = {"model.safetensors": st_save({k: v.detach().contiguous().cpu() for k, v in state.model.items()}, meta),
             "rng.pt": _torch_bytes(state.rng), "extra.json": state.extra_json.encode()}
    if state.reference is not None:
        files["reference.safetensors"] = st_save({k: v.detach().contiguous().cpu()
                                                  for k, v in state.reference.items()}, meta)
    if state.optimizer is not None:
        files["optimizer.pt"] = _torch_bytes(state.optimizer)
    return files


def _finalize(tmp: Path, final: Path) -> None:
    """The commit point of a step directory: one rename (a test hook kills the writer here)."""
    os.rename(tmp, final)


def save_checkpoint(root: str | os.PathLike[str], state: CheckpointState) -> Path:
    """Write ``state`` as ``root/step-NNNNNN`` and point ``root/latest`` at it; returns the step
    directory. Checkpoints are immutable: saving a step that already exists is an error."""
    root = Path(root)
    private_dirs(root)
    name = step_dir_name(state.step)
    final = root / name
    if final.exists():
        raise CheckpointError(f"checkpoint {final} already exists (checkpoints are immutable)")
    tmp = root / f".{name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    tmp.mkdir(mode=0o700)
    try:
        sums = {fname: _write(tmp / fname, data) for fname, data in _encode(state).items()}
        manifest = json.dumps({"format": FORMAT, "step": state.step, "model": state.model_name,
                               "kernel_fingerprint": state.kernel_fingerprint, "files": sums},
                              indent=1, sort_keys=True).encode()
        manifest_sha = _write(tmp / MANIFEST, manifest)
        _fsync_dir(tmp)
        _finalize(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    _fsync_dir(root)
    pointer = json.dumps({"dir": name, "manifest_sha256": manifest_sha}).encode()
    atomic_write_bytes(root / LATEST, pointer)
    return final


def _remove_dir(path: Path) -> None:
    """Delete a directory so that no reader sees it half deleted: renamed out of the way first (one
    atomic step), then removed."""
    trash = path.with_name(f".deleted-{path.name}-{uuid.uuid4().hex[:8]}")
    os.rename(path, trash)
    shutil.rmtree(trash, ignore_errors=True)


def prune_checkpoints(root: str | os.PathLike[str], keep_last: int) -> list[Path]:
    """Delete every step directory under ``root`` but the newest ``keep_last`` (the one ``latest``
    points at is always kept), and what an interrupted prune left; returns the deleted ones."""
    if keep_last < 1:
        raise ValueError("keep_last must be >= 1")
    root = Path(root)
    current, _ = resolve(root)
    steps = sorted((p for p in root.iterdir() if _STEP_DIR.match(p.name) and p.is_dir()),
                   key=lambda p: int(_STEP_DIR.match(p.name).group(1)))  # type: ignore[union-attr]
    doomed = [p for p in steps[:-keep_last] if p.name != current.name]
    for p in doomed:
        _remove_dir(p)
    for leftover in root.glob(".deleted-step-*"):
        shutil.rmtree(leftover, ignore_errors=True)
    if doomed:
        _fsync_dir(root)
    return doomed


#: Free space kept beyond a checkpoint's size, so that a save never fills a disk to its last byte.
FREE_SPACE_MARGIN = 64 << 20


def checkpoint_bytes(root: str | os.PathLike[str], model_bytes: int) -> int:
    """What the next checkpoint under ``root`` will take: the newest one's size, or, before the first,
    4x the model's bytes (weights plus AdamW's two moments, and room for the RNG state)."""
    root = Path(root)
    steps = sorted((p for p in root.iterdir() if _STEP_DIR.match(p.name) and p.is_dir()),
                   key=lambda p: p.name) if root.is_dir() else []
    if steps:
        return sum(f.stat().st_size for f in steps[-1].iterdir() if f.is_file())
    return 4 * model_bytes


def check_free_space(root: str | os.PathLike[str], model_bytes: int) -> None:
    """``CheckpointError`` when the disk under ``root`` cannot take the next checkpoint (checked
    before writing, so a full disk fails the save cleanly instead of tearing it)."""
    root = Path(root)
    probe = root if root.exists() else next((p for p in root.parents if p.exists()), Path("/"))
    need, free = checkpoint_bytes(root, model_bytes) + FREE_SPACE_MARGIN, shutil.disk_usage(probe).free
    if free < need:
        raise CheckpointError(f"not enough free space under {root} for a checkpoint: about {need >> 20} MiB "
                              f"needed, {free >> 20} MiB free")


def _read_verified(path: Path, want: str) -> bytes:
    try:
        data = path.read_bytes()
    except OSError as e:
        raise CheckpointError(f"checkpoint file {path} is missing or unreadable ({e})") from None
    if hashlib.sha256(data).hexdigest() != want:
        raise CheckpointError(f"checkpoint file {path}: sha256 does not match its manifest (corrupt)")
    return data


def _safetensors_metadata(data: bytes) -> dict[str, str] | None:
    """The ``__metadata__`` of a safetensors file's JSON header (8-byte little-endian length first)."""
    try:
        n = int.from_bytes(data[:8], "little")
        return json.loads(data[8:8 + n]).get("__metadata__")
    except (ValueError, AttributeError):
        return None


def resolve(path: str | os.PathLike[str]) -> tuple[Path, str | None]:
    """The step directory ``path`` names — itself, or the target of its ``latest`` pointer — and the
    manifest sha256 the pointer vouches for (``None`` for a directly named step directory)."""
    path = Path(path)
    if (path / MANIFEST).is_file() and not (path / LATEST).exists():
        return path, None
    pointer = path / LATEST
    if not pointer.is_file():
        raise CheckpointError(f"{path}: no checkpoint ({LATEST} pointer or {MANIFEST} not found)")
    try:
        ref = json.loads(pointer.read_text())
        name, manifest_sha = ref["dir"], ref["manifest_sha256"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise CheckpointError(f"{pointer}: corrupt latest pointer ({e})") from None
    if not isinstance(name, str) or not _STEP_DIR.match(name) or not isinstance(manifest_sha, str):
        raise CheckpointError(f"{pointer}: corrupt latest pointer (names {name!r})")
    step_dir = path / name
    if not step_dir.is_dir():
        raise CheckpointError(f"{pointer} points at {name}, which does not exist")
    return step_dir, manifest_sha


def load_checkpoint(path: str | os.PathLike[str]) -> CheckpointState:
    """Load and verify the checkpoint at ``path`` (a root with ``latest``, or a step directory)."""
    step_dir, manifest_sha = resolve(path)
    raw = (step_dir / MANIFEST).read_bytes() if manifest_sha is None else _read_verified(step_dir / MANIFEST,
                                                                                         manifest_sha)
    try:
        manifest = json.loads(raw)
        sums: dict[str, str] = manifest["files"]
        step, model_name, fingerprint = int(manifest["step"]), manifest["model"], manifest["kernel_fingerprint"]
        fmt = manifest["format"]
    except (ValueError, KeyError, TypeError) as e:
        raise CheckpointError(f"{step_dir / MANIFEST}: corrupt manifest ({e})") from None
    if fmt != FORMAT:
        raise CheckpointError(f"{step_dir}: checkpoint format {fmt}, this build reads format {FORMAT}")
    for required in ("model.safetensors", "rng.pt", "extra.json"):
        if required not in sums:
            raise CheckpointError(f"{step_dir / MANIFEST}: lists no {required}")
    unknown = sorted(set(sums) - set(FILES))
    if unknown:
        raise CheckpointError(f"{step_dir / MANIFEST}: lists unknown files {unknown}")
    data = {name: _read_verified(step_dir / name, want) for name, want in sorted(sums.items())}
    # the manifest's own fields, checked against the directory name and the (verified) weights file
    meta = _safetensors_metadata(data["model.safetensors"])
    claimed = {"step": str(step), "model": model_name, "kernel_fingerprint": fingerprint}
    named = _STEP_DIR.match(step_dir.name)
    if meta != claimed or (named is not None and int(named.group(1)) != step):
        raise CheckpointError(f"{step_dir / MANIFEST}: manifest {claimed} disagrees with the weights file "
                              f"({meta}) or the directory name")
    try:
        def tensors(name: str) -> dict[str, Tensor] | None:
            return st_load(data[name]) if name in data else None

        def pickled(name: str) -> Any:
            return torch.load(io.BytesIO(data[name]), weights_only=True) if name in data else None

        return CheckpointState(step=step, model_name=model_name, kernel_fingerprint=fingerprint,
                               model=tensors("model.safetensors") or {}, optimizer=pickled("optimizer.pt"),
                               rng=pickled("rng.pt"), extra_json=data["extra.json"].decode(),
                               reference=tensors("reference.safetensors"), path=step_dir)
    except Exception as e:  # verified bytes that still do not parse: written by a different build
        raise CheckpointError(f"{step_dir}: checkpoint files do not parse ({e})") from e
