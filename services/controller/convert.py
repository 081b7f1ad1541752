"""``onpolicy.v1`` job messages <-> the controller's records and the pydantic ``JobSpec``.

Spec fields have the same names on both sides and are converted field by field. Every scalar of the
spec messages has presence (proto3 ``optional``): a field the caller set arrives exactly as set, 0,
"" and false included; an unset field (or an empty list or map) is absent for pydantic and takes the
documented default.
"""

from __future__ import annotations

from typing import Any

from google.protobuf import json_format

from onpolicy.jobs.spec import JobSpec, parse_spec
from onpolicy.services import api

from .records import JobEvent, JobRecord, JobState


def message_fields(msg: Any) -> dict[str, Any]:
    """The fields ``msg`` carries, as plain values: a scalar when it is set, a sub-message when it is
    present, a list or map when it is not empty (sub-messages converted the same way)."""
    out: dict[str, Any] = {}
    for fd in msg.DESCRIPTOR.fields:
        value = getattr(msg, fd.name)
        if fd.message_type is not None and fd.message_type.GetOptions().map_entry:
            entry = fd.message_type.fields_by_name["value"]
            if value:
                out[fd.name] = {k: (message_fields(v) if entry.message_type else v) for k, v in value.items()}
        elif fd.is_repeated:
            if value:
                out[fd.name] = [message_fields(v) if fd.message_type else v for v in value]
        elif msg.HasField(fd.name):
            out[fd.name] = message_fields(value) if fd.message_type else value
    return out


def spec_from_proto(msg: Any) -> JobSpec:
    """Validate a ``JobSpec`` message (raises ``SpecError`` naming the fields)."""
    return parse_spec(message_fields(msg))


def spec_to_proto(spec: JobSpec | dict[str, Any]) -> Any:
    data = spec.model_dump(mode="json") if isinstance(spec, JobSpec) else spec
    return json_format.ParseDict(data, api.jobs_pb2.JobSpec())


def state_proto(state: JobState) -> int:
    return api.jobs_pb2.JobState.Value(f"JOB_STATE_{state.value}")


def event_proto(ev: JobEvent) -> Any:
    t = ev.times
    return api.jobs_pb2.JobEvent(
        job_id=ev.job_id, step=ev.step, state=state_proto(ev.state), reward_mean=ev.reward_mean,
        reward_std=ev.reward_std, logdiff_max=ev.logdiff_max, tokens_checked=ev.tokens_checked,
        tokens_mismatched=ev.tokens_mismatched, rollout_tokens_per_s=ev.rollout_tokens_per_s,
        trainer_tokens_per_s=ev.trainer_tokens_per_s, weight_version=ev.weight_version, loss=ev.loss,
        kl_k3=ev.kl_k3, message=ev.message, timestamp=ev.timestamp, eval_accuracy=ev.eval_accuracy,
        eval_problems=ev.eval_problems, grad_norm=ev.grad_norm, clip_fraction=ev.clip_fraction, entropy=ev.entropy,
        correction_fraction=ev.correction_fraction, groups_dropped=ev.groups_dropped, lr=ev.lr,
        logdiff_mean=ev.logdiff_mean,
        times=api.jobs_pb2.StepTimes(generate_s=t.generate_s, reward_s=t.reward_s, train_s=t.train_s,
                                     sync_s=t.sync_s, verify_s=t.verify_s, total_s=t.total_s))


def job_proto(rec: JobRecord) -> Any:
    job = api.jobs_pb2.Job(job_id=rec.job_id, spec=spec_to_proto(rec.spec), state=state_proto(rec.state),
                           step=rec.step, created_at=rec.created_at, updated_at=rec.updated_at, error=rec.error)
    if rec.last_event is not None:
        job.last_event.CopyFrom(event_proto(rec.last_event))
    return job


def event_dict(msg: Any) -> dict[str, Any]:
    """A JobEvent message as JSON with the proto's field names, every field present."""
    return json_format.MessageToDict(msg, preserving_proto_field_name=True,
                                     always_print_fields_with_no_presence=True)
