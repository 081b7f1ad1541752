"""``onpolicy bench``: benchmarks printed as a table for people, or JSON for machines.

``bench {vs-vllm,vs-hf,roofline,rl-step,all}`` are the suites of ``onpolicy.bench.suite`` and share
the options below. Another benchmark adds its own subcommand: a function ``add_parser(benches)`` that
calls ``benches.add_parser(NAME, ...)`` and sets ``func``, listed in ``_OTHER_BENCHES``.
"""

from __future__ import annotations

import argparse
import shlex
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING

from .common import emit_json, fail

if TYPE_CHECKING:
    from onpolicy.bench.suite import Setup

_SUITE_HELP = {
    "vs-vllm": "our rollout (consistent) vs vLLM's CPU engine (its own kernels): tokens/s per batch size, "
               "both engines' logdiff against our trainer (skipped with the reason where vLLM cannot run)",
    "vs-hf": "our rollout vs transformers generate; our trainer fwd+bwd vs transformers'",
    "roofline": "measured bandwidth and GEMM peak, the decode bounds they imply, our fraction of them",
    "rl-step": "one GRPO step with vs without the old-logprob recompute pass",
    "all": "every suite above, sharing measurements",
}

def _reductions(benches: argparse._SubParsersAction) -> None:
    from onpolicy.bench.reductions import add_parser as add

    add(benches)


def _load(benches: argparse._SubParsersAction) -> None:
    from onpolicy.bench.load import add_parser as add

    add(benches)


def _gemm(benches: argparse._SubParsersAction) -> None:
    from onpolicy.bench.gemm import add_parser as add

    add(benches)


def _speculative(benches: argparse._SubParsersAction) -> None:
    from onpolicy.bench.speculative import add_parser as add

    add(benches)


#: ``add_parser(benches)`` of the benchmarks that live in their own modules.
_OTHER_BENCHES: list[Callable[[argparse._SubParsersAction], None]] = [_reductions, _load, _gemm, _speculative]


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("bench", help="benchmarks: throughput ratios measured side by side")
    benches = p.add_subparsers(dest="bench", required=True, metavar="BENCH")
    for name, text in _SUITE_HELP.items():
        b = benches.add_parser(name, help=text, description=text)
        b.add_argument("--model", default="smollm2", help="smollm2 (default) | tiny-llama | ... | PATH")
        b.add_argument("--quick", action="store_true",
                       help="small sizes, fp32 only (vs-vllm: fp32 and bf16) (a smoke run, minutes)")
        b.add_argument("--json", action="store_true", help="JSON for machines instead of the table")
        b.add_argument("--dtype", choices=["fp32", "bf16", "both"],
                       help="default: both (--quick: fp32, but vs-vllm both)")
        b.add_argument("--batches", help="comma-separated rollout batch sizes (default 1,8,32, vs-vllm 1,8,32,64; "
                       "--quick 1,32)")
        b.add_argument("--prompt-len", type=int, help="prompt tokens (default 64; --quick 32)")
        b.add_argument("--new-tokens", type=int, help="generated tokens per sequence (default 128; --quick 16)")
        b.add_argument("--repeats", type=int, help="timed rollout runs after a warm-up, median reported (default 1)")
        b.add_argument("--rounds", type=int, help="side-by-side measurements alternate the engines (roofline: "
                       "the bandwidth and the batch-1 decode) this many times; medians are reported (roofline: the "
                       "median round) (default 1, vs-vllm 3; 3 on a noisy machine)")
        if name in ("vs-vllm", "all"):
            b.add_argument("--vllm-eager", action="store_true",
                           help="vLLM without torch.compile (vLLM's default): starts in seconds, not minutes "
                           "(--quick implies it)")
        b.set_defaults(func=run_suite)
    for add in _OTHER_BENCHES:
        add(benches)


def _setup(args: argparse.Namespace) -> Setup:
    from onpolicy.bench.suite import Setup

    setup = Setup.quick() if args.quick else Setup()
    changes: dict[str, object] = {}
    if args.dtype:
        changes["dtypes"] = changes["vllm_dtypes"] = ("fp32", "bf16") if args.dtype == "both" else (args.dtype,)
    if args.batches:
        try:
            changes["batches"] = tuple(int(b) for b in args.batches.split(",") if b)
        except ValueError:
            fail("--batches must be comma-separated integers")
        if not changes["batches"] or min(changes["batches"]) < 1:  # type: ignore[call-overload]
            fail("--batches must be comma-separated integers >= 1")
        changes["vllm_batches"] = changes["batches"]
    for opt in ("prompt_len", "new_tokens", "repeats", "rounds"):
        value = getattr(args, opt)
        if value is not None:
            if value < 1:
                fail(f"--{opt.replace('_', '-')} must be >= 1")
            changes[opt] = value
    if "rounds" in changes:
        changes["vllm_rounds"] = changes["rounds"]
    if getattr(args, "vllm_eager", False):
        changes["vllm_eager"] = True
    return setup.with_(**changes)


def run_suite(args: argparse.Namespace) -> int:
    from onpolicy.bench.suite import run_suites
    from onpolicy.models.loading import ModelLoadError

    setup = _setup(args)
    command = "onpolicy " + shlex.join(sys.argv[1:]) if sys.argv[1:2] == ["bench"] else f"onpolicy bench {args.bench}"
    try:
        report = run_suites(args.bench, args.model, setup, command)
    except (ModelLoadError, FileNotFoundError) as e:
        fail(str(e).splitlines()[0])
    if args.json:
        emit_json(report.to_dict())
    else:
        report.print_table()
    return 0
