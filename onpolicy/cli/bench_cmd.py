"""``onpolicy bench``: benchmarks printed as a table for people, or JSON for machines."""

from __future__ import annotations

import argparse

from .common import emit_json, fail


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("bench", help="benchmarks: throughput ratios measured side by side")
    p.add_argument("which", choices=["rollout"], help="rollout: consistent vs fast vs transformers generate")
    p.add_argument("--model", default="smollm2")
    p.add_argument("--dtype", choices=["fp32", "bf16", "both"], default="both")
    p.add_argument("--batches", default="1,8,32", help="comma-separated batch sizes (default 1,8,32)")
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--quick", action="store_true", help="batches 1,8; 32 new tokens; 1 repeat")
    p.add_argument("--no-hf", action="store_true", help="skip the transformers baseline")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from onpolicy.bench.rollout import run_rollout

    try:
        batches = [int(b) for b in args.batches.split(",") if b]
    except ValueError:
        fail("--batches must be comma-separated integers")
    if not batches or min(batches) < 1 or args.prompt_len < 1 or args.new_tokens < 1 or args.repeats < 1:
        fail("batch sizes, --prompt-len, --new-tokens and --repeats must be >= 1")
    if args.quick:
        batches, args.new_tokens, args.repeats = [b for b in batches if b <= 8] or [1], 32, 1
    dtypes = ["fp32", "bf16"] if args.dtype == "both" else [args.dtype]
    report = run_rollout(args.model, dtypes, batches, args.prompt_len, args.new_tokens, args.repeats,
                         with_hf=not args.no_hf)
    if args.json:
        emit_json(report.to_dict())
    else:
        report.print_table()
    return 0
