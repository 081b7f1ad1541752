"""Fixtures of the deployment tests (helpers in chart_tools.py)."""

from __future__ import annotations

import copy
import json
from collections.abc import Callable
from typing import Any

import pytest
from chart_tools import Rendered, need, render_cached, values_of


@pytest.fixture(scope="session")
def render() -> Callable[..., Rendered]:
    """``render("values-npu.yaml", **{"tls.enabled": True})`` (also ``tls__enabled=True``)."""
    need("helm_python", "helm-python-sdk renders the chart")

    def go(*files: str, **overrides: Any) -> Rendered:
        return copy.deepcopy(render_cached(json.dumps(values_of(*files, **overrides), sort_keys=True)))

    return go


