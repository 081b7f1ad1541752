"""``onpolicy consistency``: prove rollout logprobs equal the trainer's, bit for bit."""

from __future__ import annotations

import argparse
import sys

from onpolicy.verification.consistency import run_consistency

from .common import add_model_args, emit_json, fail, kernel_config, load


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("consistency", help="run requests under many schedules and check rollout == trainer bitwise")
    add_model_args(p)
    p.add_argument("--requests", type=int, default=16)
    p.add_argument("--max-new-tokens", type=int, default=48)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--schedules", type=int, default=3, help="randomized continuous-batching schedules (default 3)")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    for name in ("requests", "max_new_tokens"):
        if getattr(args, name) < 1:
            fail(f"--{name.replace('_', '-')} must be >= 1")
    if args.schedules < 0:
        fail("--schedules must be >= 0")
    config = kernel_config(args)
    lm = load(args, config)

    def log(msg: str) -> None:
        if not args.json:
            print(msg, file=sys.stderr, flush=True)

    log(f"consistency check of {lm.name} with {config.fingerprint}: {args.requests} requests x "
        f"{args.max_new_tokens} new tokens")
    report = run_consistency(lm, requests=args.requests, max_new_tokens=args.max_new_tokens, seed=args.seed,
                             schedules=args.schedules, log=log)
    if args.json:
        emit_json(report.to_dict())
    else:
        verdict = "PASS" if report.passed else "FAIL"
        print(f"{verdict}: {report.tokens_checked} tokens checked, {report.mismatched_tokens} mismatched, "
              f"max |logdiff| {report.max_abs_logdiff:.3g}, {len(report.schedules)} schedules "
              f"({report.schedule_mismatches} differing from the alone run)")
    return 0 if report.passed else 1
