"""The gRPC API follows buf's STANDARD lint rules (FooService, FooRequest/FooResponse, package dirs)."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

PROTOS = Path(__file__).resolve().parents[3] / "protos"


def buf_binary() -> str | None:
    for cand in (os.environ.get("ONPOLICY_BUF"), shutil.which("buf"),
                 str(Path.home() / ".cache/onpolicy-tools/node_modules/.bin/buf")):
        if cand and Path(cand).is_file():
            return cand
    return None


def test_buf_lint_standard() -> None:
    buf = buf_binary()
    if buf is None:
        if os.environ.get("CI"):
            pytest.fail("buf is not installed (.ci/run installs @bufbuild/buf from npm)")
        pytest.skip("buf not installed: npm install --prefix ~/.cache/onpolicy-tools @bufbuild/buf@1.75.0")
    proc = subprocess.run([buf, "lint"], cwd=PROTOS, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
