"""End to end over real gRPC and a real local Ray (loopback): submit, watch, cancel, list — every
step's rollout logprobs are proven bitwise equal to the trainer's by the verifier service."""

from __future__ import annotations

import secrets
import time
from pathlib import Path

import grpc
import pytest

from onpolicy.jobs.spec import load_spec_file
from onpolicy.services import api
from onpolicy.services.common.client import connect, field_violations
from onpolicy.services.controller.convert import spec_to_proto

ROOT = Path(__file__).resolve().parents[3]
TOKEN = secrets.token_urlsafe(16)


@pytest.fixture(scope="module")
def jobs(tmp_path_factory):
    from onpolicy.services.cluster.actors import RayLauncher
    from onpolicy.services.cluster.local_ray import init_ray, shutdown_ray
    from onpolicy.services.common.server import ServerConfig
    from onpolicy.services.controller.controller import JobController
    from onpolicy.services.controller.servicer import jobs_server

    init_ray()
    controller = JobController(tmp_path_factory.mktemp("controller"), RayLauncher(token=TOKEN))
    server = jobs_server(controller, ServerConfig(port=0, token=TOKEN))
    stub = api.jobs_pb2_grpc.JobServiceStub(connect(server.address, token=TOKEN))
    yield stub, controller, server
    controller.shutdown()
    server.stop()
    shutdown_ray()


def tiny_spec(**overrides):
    spec = load_spec_file(ROOT / "examples/jobs/tiny.yaml").model_dump(mode="json")
    for key, value in overrides.items():
        if isinstance(value, dict):
            spec[key] = {**spec[key], **value}
        else:
            spec[key] = value
    return spec


def submit(stub, spec) -> str:
    return stub.SubmitJob(api.jobs_pb2.SubmitJobRequest(spec=spec_to_proto(spec)), timeout=60).job.job_id


def watch(stub, job_id):
    return [r.event for r in stub.WatchJob(api.jobs_pb2.WatchJobRequest(job_id=job_id), timeout=900)]


def state(v: int) -> str:
    return api.jobs_pb2.JobState.Name(v)


def test_job_runs_three_steps_with_logdiff_exactly_zero(jobs) -> None:
    stub, _, _ = jobs
    job_id = submit(stub, tiny_spec())
    events = watch(stub, job_id)
    steps = [e for e in events if e.weight_version]
    assert [e.step for e in steps] == [1, 2, 3]
    assert [e.weight_version for e in steps] == [1, 2, 3]
    for e in steps:
        assert e.logdiff_max == 0.0 and e.tokens_mismatched == 0 and e.tokens_checked > 0
        assert e.rollout_tokens_per_s > 0 and e.trainer_tokens_per_s > 0 and e.times.total_s > 0
    assert state(events[-1].state) == "JOB_STATE_SUCCEEDED"
    job = stub.GetJob(api.jobs_pb2.GetJobRequest(job_id=job_id)).job
    assert state(job.state) == "JOB_STATE_SUCCEEDED" and job.step == 3
    assert job_id in [j.job_id for j in stub.ListJobs(api.jobs_pb2.ListJobsRequest()).jobs]


def test_fast_rollout_kernels_make_the_verifier_report_logdiff(jobs) -> None:
    stub, _, _ = jobs
    events = watch(stub, submit(stub, tiny_spec(steps=1, rollout={"kernels": "fast"})))
    steps = [e for e in events if e.weight_version]
    assert steps and steps[0].tokens_checked > 0
    assert steps[0].logdiff_max > 0 and steps[0].tokens_mismatched > 0


def test_cancel_stops_a_running_job(jobs) -> None:
    stub, controller, _ = jobs
    job_id = submit(stub, tiny_spec(steps=500))
    deadline = time.time() + 300
    while controller.get(job_id).step < 1 and time.time() < deadline:
        time.sleep(0.5)
    assert controller.get(job_id).step >= 1
    stub.CancelJob(api.jobs_pb2.CancelJobRequest(job_id=job_id))
    controller.wait(job_id, timeout=300)
    job = stub.GetJob(api.jobs_pb2.GetJobRequest(job_id=job_id)).job
    assert state(job.state) == "JOB_STATE_CANCELLED" and job.step < 500
    listed = {j.job_id: state(j.state) for j in stub.ListJobs(api.jobs_pb2.ListJobsRequest()).jobs}
    assert listed[job_id] == "JOB_STATE_CANCELLED"


def test_bad_spec_is_invalid_argument_naming_the_field(jobs) -> None:
    stub, _, _ = jobs
    spec = tiny_spec(grpo={"lr": -1.0})
    with pytest.raises(grpc.RpcError) as e:
        submit(stub, spec)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "spec.grpo.lr" in [f for f, _ in field_violations(e.value)]
    msg = api.jobs_pb2.JobSpec(model="tiny-qwen3")
    msg.rewards.add(name="os.system")
    with pytest.raises(grpc.RpcError) as e:
        stub.SubmitJob(api.jobs_pb2.SubmitJobRequest(spec=msg))
    assert "spec.rewards[0].name" in [f for f, _ in field_violations(e.value)]


def test_unknown_job_and_missing_token(jobs) -> None:
    stub, _, server = jobs
    with pytest.raises(grpc.RpcError) as e:
        stub.GetJob(api.jobs_pb2.GetJobRequest(job_id="nope"))
    assert e.value.code() == grpc.StatusCode.NOT_FOUND
    for token in (None, "wrong"):
        anon = api.jobs_pb2_grpc.JobServiceStub(connect(server.address, token=token))
        with pytest.raises(grpc.RpcError) as e:
            anon.ListJobs(api.jobs_pb2.ListJobsRequest())
        assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
