"""Running the CLI in the test process: ``run_in_process(argv, capsys)`` returns what a subprocess run
would (exit code, stdout, stderr), argparse's own exits included."""

from __future__ import annotations

import subprocess

import pytest


def run_in_process(argv: list[str], capsys: pytest.CaptureFixture[str]) -> subprocess.CompletedProcess[str]:
    from onpolicy.cli.main import main

    try:
        rc = main(argv)
    except SystemExit as e:  # argparse errors exit directly
        rc = int(e.code or 0)
    out = capsys.readouterr()
    return subprocess.CompletedProcess(argv, rc, out.out, out.err)
