"""What every subcommand shares: the one-line usage error, kernel/model options, file arguments,
JSON output. Importing it (or any command module) imports no torch, so ``--help`` is fast."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

if TYPE_CHECKING:
    from onpolicy.kernels import KernelConfig
    from onpolicy.models.loading import LoadedModel


class UsageError(Exception):
    """Bad input from the user: printed as one line, exit code 2."""


def fail(message: str) -> NoReturn:
    raise UsageError(message)


#: The largest file a flag or argument may name (tokens, certificates, samples: far smaller).
MAX_FILE_ARG_BYTES = 256 << 20


def read_file_arg(path: str, flag: str = "", max_bytes: int = MAX_FILE_ARG_BYTES) -> bytes:
    """The bytes of the file a flag (or argument) names, read at most ``max_bytes``; exit 2 with one
    line if it is missing, not a regular file, larger, or unreadable."""
    p, where = Path(path), f"{flag} {path}" if flag else path
    if not p.exists():
        fail(f"{where}: no such file")
    if not p.is_file():
        fail(f"{where}: not a regular file")
    try:
        with open(p, "rb") as f:
            data = f.read(max_bytes + 1)
    except OSError as e:
        fail(f"{where}: unreadable ({e.strerror or e})")
    if len(data) > max_bytes:
        fail(f"{where}: larger than {max_bytes >> 20} MiB")
    return data


def add_model_args(p: argparse.ArgumentParser, *, kernels: bool = True) -> None:
    p.add_argument("--model", required=True,
                   help="smollm2 | tiny-llama | tiny-qwen3 | ... | an HF directory | a .gguf file | "
                        "a Hugging Face id in the local cache (org/name)")
    p.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32", help="compute dtype (default fp32)")
    if kernels:
        p.add_argument("--kernels", default="consistent", help="consistent (default) | fast | a backend name")
    p.add_argument("--kv-tile", type=int, default=64, help="attention KV tile (default 64)")


def kernel_config(args: argparse.Namespace, kernels: str | None = None) -> KernelConfig:
    from onpolicy.kernels import KernelConfig, resolve_kernels

    try:
        backend = resolve_kernels(kernels or getattr(args, "kernels", "consistent"))
        return KernelConfig(backend=backend, compute_dtype=args.dtype, kv_tile=args.kv_tile)
    except ValueError as e:
        fail(str(e))


def load(args: argparse.Namespace, config: KernelConfig) -> LoadedModel:
    from onpolicy.kernels import get_backend
    from onpolicy.models.loading import ModelLoadError
    from onpolicy.models.registry import load_model

    try:
        return load_model(args.model, get_backend(config))
    except (ModelLoadError, FileNotFoundError, ValueError, RuntimeError) as e:
        fail(str(e).splitlines()[0])


def read_json(path: str, flag: str = "") -> Any:
    data = read_file_arg(path, flag)
    try:
        return json.loads(data.decode())
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        fail(f"{path}: not valid JSON ({e})")
    except RecursionError:
        fail(f"{path}: not valid JSON (nested too deeply)")


def emit_json(obj: Any) -> None:
    json.dump(obj, sys.stdout, separators=(",", ":"))
    sys.stdout.write("\n")
    sys.stdout.flush()
