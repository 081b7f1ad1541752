"""Job spec ``parallel``: per-role degrees (rollout tp/ep, trainer tp/ep/dp) — defaults, validation naming
the field, and the round trip through the ``onpolicy.v1.JobSpec`` message."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from onpolicy.jobs.spec import SpecError, load_spec_file, parse_spec
from onpolicy.services.controller.convert import spec_from_proto, spec_to_proto

ROOT = Path(__file__).resolve().parents[2]
MODEL = {"model": "tiny-qwen3"}


def _violations(data: dict) -> dict[str, str]:
    with pytest.raises(SpecError) as e:
        parse_spec({**MODEL, **data})
    return dict(e.value.violations)


def test_defaults_are_one_everywhere() -> None:
    p = parse_spec(MODEL).parallel
    assert (p.rollout.tp, p.rollout.ep, p.trainer.tp, p.trainer.ep, p.trainer.dp) == (1, 1, 1, 1, 1)


@pytest.mark.parametrize(("role", "field", "value", "message"), [
    ("rollout", "tp", 3, "tp must be a power of two, got 3"),
    ("rollout", "ep", 0, "greater than or equal to 1"),
    ("trainer", "tp", 6, "tp must be a power of two, got 6"),
    ("trainer", "ep", 128, "less than or equal to 64"),
    ("trainer", "dp", 12, "dp must be a power of two, got 12"),
    ("trainer", "dp", -2, "greater than or equal to 1"),
])
def test_bad_degrees_name_their_field(role: str, field: str, value: int, message: str) -> None:
    bad = _violations({"parallel": {role: {field: value}}})
    assert list(bad) == [f"parallel.{role}.{field}"] and message in bad[f"parallel.{role}.{field}"]


def test_unknown_degrees_are_refused() -> None:
    assert "parallel.rollout.dp" in _violations({"parallel": {"rollout": {"dp": 2}}})  # rollout replicas: not a degree
    assert "parallel.trainer.pp" in _violations({"parallel": {"trainer": {"pp": 2}}})


def test_dp_must_leave_every_rank_a_sample() -> None:
    grpo = {"prompts_per_step": 2, "group_size": 4, "minibatches": 2}  # 4 samples per minibatch
    assert parse_spec({**MODEL, "grpo": grpo, "parallel": {"trainer": {"dp": 4}}}).parallel.trainer.dp == 4
    bad = _violations({"grpo": grpo, "parallel": {"trainer": {"dp": 8}}})
    assert list(bad) == ["parallel.trainer.dp"] and "8 data-parallel ranks exceed the 4 samples" in bad[
        "parallel.trainer.dp"]


def test_degrees_cross_the_wire_and_absent_means_one() -> None:
    spec = parse_spec({**MODEL, "parallel": {"rollout": {"tp": 2}, "trainer": {"tp": 4, "ep": 2, "dp": 2}}})
    msg = spec_to_proto(spec)
    assert (msg.parallel.trainer.dp, msg.parallel.trainer.tp, msg.parallel.rollout.tp) == (2, 4, 2)
    assert spec_from_proto(msg) == spec
    msg.ClearField("parallel")
    assert spec_from_proto(msg).parallel == parse_spec(MODEL).parallel


def test_example_jobs_spell_out_their_degrees() -> None:
    for path in sorted((ROOT / "examples/jobs").glob("*.yaml")):
        assert "parallel" in yaml.safe_load(path.read_text()), path
        assert load_spec_file(path).parallel == parse_spec(MODEL).parallel, path
