"""``onpolicy.v1`` job messages <-> the controller's records and the pydantic ``JobSpec``.

Spec fields have the same names on both sides; a field left at its proto default (0, "", empty)
is absent for pydantic and takes the documented default.
"""

from __future__ import annotations

from typing import Any

from google.protobuf import json_format

from onpolicy.jobs.spec import JobSpec, parse_spec
from onpolicy.services import api

from .records import JobEvent, JobRecord, JobState


def spec_from_proto(msg: Any) -> JobSpec:
    """Validate a ``JobSpec`` message (raises ``SpecError`` naming the fields)."""
    return parse_spec(json_format.MessageToDict(msg, preserving_proto_field_name=True))


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
        kl_k3=ev.kl_k3, message=ev.message, timestamp=ev.timestamp,
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
