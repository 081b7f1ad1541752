"""What a caller sets in a ``JobSpec`` message arrives exactly as set, 0 included, field by field:
the conversion keeps every scalar the caller set (proto3 presence) and drops only unset ones."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic import BaseModel

from onpolicy.jobs.spec import JobSpec, SpecError, load_spec_file
from onpolicy.services import api
from onpolicy.services.controller.convert import spec_from_proto, spec_to_proto

ROOT = Path(__file__).resolve().parents[2]
BASE = load_spec_file(ROOT / "examples/jobs/tiny.yaml")


def leaves(descriptor: Any, prefix: tuple[str, ...] = ()) -> list[tuple[tuple[str, ...], Any]]:
    """(path, field descriptor) of every scalar of a spec message, through its sub-messages."""
    out = []
    for fd in descriptor.fields:
        if fd.is_repeated:  # rewards (repeated) and resources (map) are covered by their own tests
            continue
        if fd.message_type is not None:
            out += leaves(fd.message_type, (*prefix, fd.name))
        else:
            out.append(((*prefix, fd.name), fd))
    return out


LEAVES = leaves(api.jobs_pb2.JobSpec.DESCRIPTOR)
IDS = [".".join(p) for p, _ in LEAVES]


def zero(fd: Any) -> Any:
    return {fd.TYPE_STRING: "", fd.TYPE_BOOL: False, fd.TYPE_DOUBLE: 0.0}.get(fd.type, 0)


def set_leaf(msg: Any, path: tuple[str, ...], value: Any) -> None:
    for name in path[:-1]:
        msg = getattr(msg, name)
    setattr(msg, path[-1], value)


def get_path(spec: BaseModel, path: tuple[str, ...]) -> Any:
    value: Any = spec
    for name in path:
        value = getattr(value, name)
    return value


def arrives_exactly(path: tuple[str, ...], value: Any) -> None:
    """``value`` set at ``path`` of a valid spec either arrives exactly or is refused naming ``path``."""
    msg = spec_to_proto(BASE)
    set_leaf(msg, path, value)
    try:
        spec = spec_from_proto(msg)
    except SpecError as e:
        assert ".".join(path) in [f for f, _ in e.violations], (path, value, e.violations)
        return
    got = get_path(spec, path)
    assert (got == value and type(got) is type(value)) or (isinstance(value, int) and got == value), (path, value, got)


def test_every_proto_field_is_a_spec_field_and_back() -> None:
    def names(model: type[BaseModel], descriptor: Any, where: str) -> None:
        proto = {fd.name for fd in descriptor.fields}
        assert proto == set(model.model_fields), where
        for fd in descriptor.fields:
            ann = model.model_fields[fd.name].annotation
            if fd.message_type is not None and isinstance(ann, type) and issubclass(ann, BaseModel):
                names(ann, fd.message_type, f"{where}.{fd.name}")

    names(JobSpec, api.jobs_pb2.JobSpec.DESCRIPTOR, "spec")


@pytest.mark.parametrize(("path", "fd"), LEAVES, ids=IDS)
def test_a_zero_value_arrives_as_zero_or_is_refused_by_name(path: tuple[str, ...], fd: Any) -> None:
    arrives_exactly(path, zero(fd))


def test_the_zeros_the_issue_names_arrive_exactly() -> None:
    msg = spec_to_proto(BASE)
    msg.rollout.temperature = 0.0
    msg.verifier.sample_fraction = 0.0
    msg.grpo.clip_eps_low = 0.0
    msg.checkpoint.interval = 0
    msg.resources["trainer"].cpus = 0.0
    msg.rewards[1].weight = 0.0
    spec = spec_from_proto(msg)
    assert spec.rollout.temperature == 0.0 and spec.verifier.sample_fraction == 0.0
    assert spec.grpo.clip_eps_low == 0.0 and spec.checkpoint.interval == 0
    assert spec.resources["trainer"].cpus == 0.0 and spec.rewards[1].weight == 0.0
    # and back out: GetJob's spec carries them as set
    again = spec_to_proto(spec)
    assert again.rollout.HasField("temperature") and again.rollout.temperature == 0.0
    assert spec_from_proto(again) == spec


def test_unset_fields_take_the_documented_defaults() -> None:
    msg = api.jobs_pb2.JobSpec(model="tiny-qwen3")
    spec = spec_from_proto(msg)
    assert spec == JobSpec(model="tiny-qwen3")
    assert spec.rollout.temperature == 1.0 and spec.checkpoint.interval == 1


def _value_strategy(fd: Any) -> st.SearchStrategy[Any]:
    if fd.type == fd.TYPE_BOOL:
        return st.booleans()
    if fd.type == fd.TYPE_STRING:
        return st.text(max_size=12)
    if fd.type == fd.TYPE_DOUBLE:
        return st.floats(allow_nan=False, allow_infinity=False, width=64)
    bits = 63 if fd.type == fd.TYPE_INT64 else 31
    return st.integers(-(1 << bits), (1 << bits) - 1)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_any_value_of_any_field_arrives_exactly_or_is_refused_by_name(data: st.DataObject) -> None:
    path, fd = data.draw(st.sampled_from(LEAVES))
    arrives_exactly(path, data.draw(_value_strategy(fd)))
