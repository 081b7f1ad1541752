"""``onpolicy consistency``: prove rollout logprobs equal the trainer's, bit for bit — in one
process, or with ``--rollout-tp/--trainer-tp/--rollout-ep/--trainer-ep`` on local worker processes
(loopback gloo), the rollout engine and the training path each at its own parallel degrees."""

from __future__ import annotations

import argparse
import random
import sys
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from onpolicy.rollout.names import ENGINES, OWN_ENGINE

from .common import add_model_args, emit_json, fail, kernel_config, load
from .generate_cmd import check_engine_available

if TYPE_CHECKING:
    from onpolicy.kernels import KernelConfig
    from onpolicy.models.loading import LoadedModel


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("consistency", help="run requests under many schedules and check rollout == trainer bitwise")
    add_model_args(p)
    p.add_argument("--requests", type=int, default=16)
    p.add_argument("--max-new-tokens", type=int, default=48)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--schedules", type=int, default=3, help="randomized continuous-batching schedules (default 3)")
    p.add_argument("--engine", choices=list(ENGINES), default=OWN_ENGINE,
                   help="onpolicy (default) or vllm: the batch-invariance suite on vLLM with our operators "
                        "(--kernels fast: vLLM's own kernels, the negative control that must fail)")
    for role in ("rollout", "trainer"):
        p.add_argument(f"--{role}-tp", type=int, default=1, help=f"{role} tensor-parallel degree (default 1)")
        p.add_argument(f"--{role}-ep", type=int, default=1, help=f"{role} expert-parallel degree (default 1)")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds for the worker processes (default 600)")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=run)


def _degrees(args: argparse.Namespace) -> dict[str, int]:
    return {f"{r}_{d}": getattr(args, f"{r}_{d}") for r in ("rollout", "trainer") for d in ("tp", "ep")}


def _check_degrees(args: argparse.Namespace, lm: LoadedModel, config: KernelConfig) -> None:
    from onpolicy.parallel.layout import check_degrees

    for role in ("rollout", "trainer"):
        tp, ep = getattr(args, f"{role}_tp"), getattr(args, f"{role}_ep")
        for d, v in (("tp", tp), ("ep", ep)):
            if v < 1 or v & (v - 1) or v > 8:
                fail(f"--{role}-{d} must be a power of two from 1 to 8, got {v}")
        try:
            check_degrees(lm.config, tp, ep, config.reduce_chunks)
        except ValueError as e:
            fail(f"--{role}-tp {tp} --{role}-ep {ep}: {e}")


def _run_parallel(args: argparse.Namespace, lm: LoadedModel, config: KernelConfig, log: Callable[[str], None]) -> int:
    """One rollout at the rollout degrees and its recompute at the trainer degrees, on local workers."""
    from onpolicy.parallel.check import CheckSpec, Job, run_checks
    from onpolicy.parallel.launch import WorkerError
    from onpolicy.verification.consistency import build_prompts
    from onpolicy.verification.logdiff import compare

    prompts = build_prompts(lm, args.requests, random.Random(args.seed))
    jobs = [Job("rollout", args.rollout_tp, args.rollout_ep), Job("trainer", args.trainer_tp, args.trainer_ep)]
    spec = CheckSpec(args.model, config.to_dict(), jobs, prompts=prompts, max_new_tokens=args.max_new_tokens,
                     seed=args.seed)
    t0 = time.perf_counter()
    try:
        rollout, trainer = run_checks([spec], timeout_s=args.timeout)[0][0] or []
    except WorkerError as e:
        print(f"error: {str(e).splitlines()[0]}", file=sys.stderr)
        return 1
    stats = compare(rollout.logprobs, trainer.logprobs)
    report = {"model": lm.name, "kernel_fingerprint": config.fingerprint, "requests": args.requests,
              **_degrees(args), "tokens_checked": stats.tokens_checked, "mismatched_tokens": stats.mismatched_tokens,
              "max_abs_logdiff": stats.max_abs_logdiff, "seconds": round(time.perf_counter() - t0, 2),
              "passed": stats.mismatched_tokens == 0}
    log(f"rollout tp={args.rollout_tp} ep={args.rollout_ep} vs trainer tp={args.trainer_tp} ep={args.trainer_ep}: "
        f"{stats.tokens_checked} tokens in {report['seconds']}s")
    if args.json:
        emit_json(report)
    else:
        verdict = "PASS" if report["passed"] else "FAIL"
        print(f"{verdict}: {stats.tokens_checked} tokens checked, {stats.mismatched_tokens} mismatched, "
              f"max |logdiff| {stats.max_abs_logdiff:.3g} (rollout tp={args.rollout_tp} ep={args.rollout_ep}, "
              f"trainer tp={args.trainer_tp} ep={args.trainer_ep})")
    return 0 if report["passed"] else 1


def _run_engine_suite(args: argparse.Namespace, config: KernelConfig, log: Callable[[str], None]) -> int:
    """The batch-invariance suite on the vLLM engine; the training path on the consistent operators."""
    from onpolicy.rollout.vllm.engine import VllmEngine
    from onpolicy.verification.batch_invariance import run_batch_invariance

    trainer_lm = load(args, config.with_(backend="reference"))
    mirror = trainer_lm if config.consistent else load(args, config)
    log(f"batch-invariance suite of {trainer_lm.name} on vLLM with {config.fingerprint}: {args.requests} targets x "
        f"{args.max_new_tokens} new tokens")
    report = run_batch_invariance(lambda cfg: VllmEngine(args.model, config, cfg, lm=mirror), trainer_lm,
                                  requests=args.requests, max_new_tokens=args.max_new_tokens, seed=args.seed, log=log)
    return _verdict(args, report)


def _verdict(args: argparse.Namespace, report) -> int:
    if args.json:
        emit_json(report.to_dict())
    else:
        verdict = "PASS" if report.passed else "FAIL"
        print(f"{verdict}: {report.tokens_checked} tokens checked, {report.mismatched_tokens} mismatched, "
              f"max |logdiff| {report.max_abs_logdiff:.3g}, {len(report.schedules)} schedules "
              f"({report.schedule_mismatches} differing from the alone run)")
    return 0 if report.passed else 1


def run(args: argparse.Namespace) -> int:
    from onpolicy.verification.consistency import run_consistency

    for name in ("requests", "max_new_tokens"):
        if getattr(args, name) < 1:
            fail(f"--{name.replace('_', '-')} must be >= 1")
    if args.schedules < 0:
        fail("--schedules must be >= 0")
    if args.engine != OWN_ENGINE and any(v > 1 for v in _degrees(args).values()):
        fail(f"--engine {args.engine}: parallel degrees apply to the onpolicy engine only")
    check_engine_available(args)
    config = kernel_config(args)

    def log(msg: str) -> None:
        if not args.json:
            print(msg, file=sys.stderr, flush=True)

    if args.engine != OWN_ENGINE:
        return _run_engine_suite(args, config, log)
    lm = load(args, config)
    _check_degrees(args, lm, config)

    if any(v > 1 for v in _degrees(args).values()):
        return _run_parallel(args, lm, config, log)

    log(f"consistency check of {lm.name} with {config.fingerprint}: {args.requests} requests x "
        f"{args.max_new_tokens} new tokens")
    report = run_consistency(lm, requests=args.requests, max_new_tokens=args.max_new_tokens, seed=args.seed,
                             schedules=args.schedules, log=log)
    return _verdict(args, report)
