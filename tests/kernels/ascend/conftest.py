"""Fixtures of the Ascend backend tests: the g++-built host tiling + replay library."""

from __future__ import annotations

from pathlib import Path

import pytest
from ascend_cpu_support import NativeLib, build_library, compiler


@pytest.fixture(scope="session")
def native(tmp_path_factory: pytest.TempPathFactory) -> NativeLib:
    if compiler() is None:
        pytest.skip("g++ is not installed")
    out: Path = tmp_path_factory.mktemp("ascendc_cpu")
    return NativeLib(build_library(out))
