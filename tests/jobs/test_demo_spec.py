"""The demo job has one definition (``onpolicy.jobs.demo.demo_spec``): ``examples/jobs/demo.yaml``
is the same spec, field for field, so ``onpolicy submit examples/jobs/demo.yaml`` runs what
``onpolicy demo`` runs."""

from __future__ import annotations

from pathlib import Path

from onpolicy.jobs.demo import demo_spec
from onpolicy.jobs.spec import load_spec_file, parse_spec

ROOT = Path(__file__).resolve().parents[2]


def test_the_example_file_is_the_demo_spec() -> None:
    example = load_spec_file(ROOT / "examples/jobs/demo.yaml")
    assert example == parse_spec(demo_spec())
    assert example != parse_spec(demo_spec(lr=1e-5))  # the comparison sees a changed field
