"""``onpolicy selftest``: certify a backend on this machine for a model's shapes."""

from __future__ import annotations

import argparse
import sys
from typing import TYPE_CHECKING

from .common import emit_json, kernel_config

if TYPE_CHECKING:
    from onpolicy.kernels.selftest import ProbeShapes


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("selftest", help="certify a kernel backend on this machine (bitwise invariance probes)")
    p.add_argument("--backend", default="reference", help="backend to certify (default reference)")
    p.add_argument("--model", default="smollm2", help="model whose shapes are probed (default smollm2)")
    p.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32")
    p.add_argument("--kv-tile", type=int, default=64)
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.set_defaults(func=run)


def shapes_for(model: str) -> ProbeShapes:
    from onpolicy.kernels import KernelConfig, get_backend
    from onpolicy.models.registry import load_model

    from .common import fail

    try:
        return load_model(model, get_backend(KernelConfig())).config.probe_shapes()
    except (OSError, ValueError) as e:
        fail(str(e).splitlines()[0])


def run(args: argparse.Namespace) -> int:
    from onpolicy.kernels import get_backend
    from onpolicy.kernels.selftest import run_selftest, save_certificate

    from .common import fail

    config = kernel_config(args, args.backend)
    try:
        get_backend(config)  # a backend that cannot run here (e.g. ascend without an NPU) says why
    except RuntimeError as e:
        fail(str(e).splitlines()[0])
    shapes = shapes_for(args.model)

    def progress(line: str) -> None:
        if not args.json:
            print(line, flush=True)

    if not args.json:
        print(f"certifying {config.fingerprint} for {args.model} shapes on this machine", flush=True)
    report = run_selftest(config, shapes, progress)
    path = save_certificate(report, config)
    if args.json:
        emit_json(report.to_dict())
    else:
        n = sum(p.checked for p in report.probes)
        verdict = "CERTIFIED" if report.certified else "NOT CERTIFIED"
        print(f"{verdict}: {sum(p.passed for p in report.probes)}/{len(report.probes)} probes, {n} bitwise "
              f"checks, {report.seconds:.1f}s; report saved to {path}", file=sys.stdout)
    return 0 if report.certified else 1
