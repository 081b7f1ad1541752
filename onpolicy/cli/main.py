"""Entry point of the ``onpolicy`` command."""

from __future__ import annotations

import argparse
import os
import sys
from typing import NoReturn

from . import (
    bench_cmd,
    consistency_cmd,
    diagnose_cmd,
    export_cmd,
    generate_cmd,
    jobs_cmd,
    logprobs_cmd,
    report_cmd,
    selftest_cmd,
    up_cmd,
)
from .common import UsageError

COMMANDS = [selftest_cmd, logprobs_cmd, generate_cmd, consistency_cmd, diagnose_cmd, up_cmd, jobs_cmd, export_cmd,
            report_cmd, bench_cmd]


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:  # one line, exit 2
        self.exit(2, f"{self.prog}: error: {message}\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="onpolicy", description="True on-policy RL post-training: bitwise-identical "
                     "rollout and trainer logprobs.")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    for cmd in COMMANDS:
        cmd.add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except UsageError as e:
        print(f"onpolicy {args.command}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
