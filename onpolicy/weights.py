"""Versioned weight files: how the trainer publishes weights and rollout/verifier load them.

A version is one safetensors file ``weights-v000007.safetensors`` on storage shared by all roles,
written atomically (temporary file, fsync, rename), carrying ``version``, ``kernel_fingerprint`` and
``model`` in its metadata. Its sha256 (of the file's bytes) travels in the ``WeightsRef``; every load
verifies the checksum and the kernel fingerprint before touching the model, and refuses on mismatch.
"""

from __future__ import annotations

import hashlib
import os
import re
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save

_CHUNK = 1 << 20


class WeightsError(ValueError):
    """A weight file is missing, corrupt, or does not belong to this model / operator set."""


@dataclass(frozen=True)
class WeightsRef:
    path: str
    sha256: str
    version: int
    kernel_fingerprint: str


def file_sha256(path: str | os.PathLike[str]) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def private_dirs(directory: Path) -> None:
    """``directory`` and every missing parent of it made 0700 (``mkdir(parents=True, mode=…)`` gives
    the mode to the last level only); directories that exist keep theirs."""
    missing = []
    d = Path(directory)
    while not d.exists():
        missing.append(d)
        d = d.parent
    for m in reversed(missing):
        m.mkdir(mode=0o700, exist_ok=True)


def atomic_write_bytes(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` so that a crash leaves either the old file or the new one; the
    file is 0600 and a directory made for it 0700 (weights, checkpoints and job state are private)."""
    private_dirs(path.parent)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    with os.fdopen(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "wb") as f:
        os.fchmod(f.fileno(), 0o600)  # a leftover tmp file keeps its old mode through O_CREAT
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    dirfd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dirfd)
    finally:
        os.close(dirfd)


def export_weights(state: dict[str, torch.Tensor], directory: str | os.PathLike[str], version: int,
                   kernel_fingerprint: str, model: str) -> WeightsRef:
    tensors = {k: v.detach().contiguous().cpu() for k, v in state.items()}
    meta = {"version": str(version), "kernel_fingerprint": kernel_fingerprint, "model": model}
    data = save(tensors, metadata=meta)
    path = Path(directory) / f"weights-v{version:06d}.safetensors"
    atomic_write_bytes(path, data)
    return WeightsRef(str(path), hashlib.sha256(data).hexdigest(), version, kernel_fingerprint)


_VERSION_FILE = re.compile(r"^weights-v(\d{6,})\.safetensors$")


def prune_weight_versions(directory: str | os.PathLike[str], keep_last: int) -> list[Path]:
    """Delete every weight version file in ``directory`` but the newest ``keep_last`` (each an
    atomic unlink); returns the deleted ones."""
    if keep_last < 1:
        raise ValueError("keep_last must be >= 1")
    found = sorted((int(m.group(1)), p) for p in Path(directory).iterdir() if (m := _VERSION_FILE.match(p.name)))
    doomed = [p for _, p in found[:-keep_last]]
    for p in doomed:
        p.unlink(missing_ok=True)
    return doomed


def load_weights(ref: WeightsRef, expected_fingerprint: str) -> dict[str, torch.Tensor]:
    """Read a weight version after verifying its checksum and kernel fingerprint."""
    path = Path(ref.path)
    if not path.is_file():
        raise WeightsError(f"weights file {ref.path} does not exist")
    if not ref.sha256 or file_sha256(path) != ref.sha256:
        raise WeightsError(f"weights file {ref.path}: sha256 does not match (corrupt or wrong file)")
    if ref.kernel_fingerprint != expected_fingerprint:
        raise WeightsError(f"weights carry kernel fingerprint {ref.kernel_fingerprint!r}, "
                           f"this service runs {expected_fingerprint!r}")
    try:
        with safe_open(str(path), "pt") as f:
            meta = f.metadata() or {}
            if meta.get("kernel_fingerprint") != expected_fingerprint:
                raise WeightsError(f"{ref.path}: file metadata names kernel fingerprint "
                                   f"{meta.get('kernel_fingerprint')!r}, expected {expected_fingerprint!r}")
            if meta.get("version") != str(ref.version):
                raise WeightsError(f"{ref.path}: file is version {meta.get('version')}, reference says {ref.version}")
            return {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 - safe_open has no iteration
    except WeightsError:
        raise
    except Exception as e:  # safetensors raises its own error types on malformed files
        raise WeightsError(f"{ref.path}: unreadable weights file ({e})") from e
