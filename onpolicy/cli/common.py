"""What every subcommand shares: the one-line usage error, kernel/model options, JSON output."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any, NoReturn

from onpolicy.kernels import KernelConfig, get_backend, resolve_kernels
from onpolicy.models.checkpoint import CheckpointError, LoadedModel


class UsageError(Exception):
    """Bad input from the user: printed as one line, exit code 2."""


def fail(message: str) -> NoReturn:
    raise UsageError(message)


def add_model_args(p: argparse.ArgumentParser, *, kernels: bool = True) -> None:
    p.add_argument("--model", required=True, help="smollm2 | tiny-llama | tiny-qwen3 | tiny-qwen3-moe | PATH")
    p.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32", help="compute dtype (default fp32)")
    if kernels:
        p.add_argument("--kernels", default="consistent", help="consistent (default) | fast | a backend name")
    p.add_argument("--kv-tile", type=int, default=64, help="attention KV tile (default 64)")


def kernel_config(args: argparse.Namespace, kernels: str | None = None) -> KernelConfig:
    try:
        backend = resolve_kernels(kernels or getattr(args, "kernels", "consistent"))
        return KernelConfig(backend=backend, compute_dtype=args.dtype, kv_tile=args.kv_tile)
    except ValueError as e:
        fail(str(e))


def load(args: argparse.Namespace, config: KernelConfig) -> LoadedModel:
    from onpolicy.models.registry import load_model

    try:
        return load_model(args.model, get_backend(config))
    except (CheckpointError, FileNotFoundError, ValueError, RuntimeError) as e:
        fail(str(e).splitlines()[0])


def read_json(path: str) -> Any:
    p = Path(path)
    if not p.is_file():
        fail(f"{path}: no such file")
    try:
        return json.loads(p.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        fail(f"{path}: not valid JSON ({e})")


def emit_json(obj: Any) -> None:
    json.dump(obj, sys.stdout, separators=(",", ":"))
    sys.stdout.write("\n")
    sys.stdout.flush()
