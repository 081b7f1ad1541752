"""Property-based fuzzing of the RPCs test_fuzz_rpcs.py leaves out — every VerifierService RPC, the
trainer's weight export and checkpoint RPCs, every JobService RPC — with malformed and extreme
values (huge and NaN/inf numbers, out-of-vocabulary ids, unknown job ids, wrong weight
fingerprints, odd paths): only proper status codes come back and the service keeps serving.

The JobService runs on a real controller whose launcher has no cluster: a spec that validates is
accepted and its job then fails cleanly (FAILED with a message), which is the property under test —
no launch is needed to fuzz the API surface."""

from __future__ import annotations

import contextlib

import grpc
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_fuzz_rpcs import ALLOWED, FLOATS, IDS, INT32, INT64, call_ok_or_allowed, still_serving

from onpolicy.kernels import KernelConfig
from onpolicy.services import api
from onpolicy.services.common.client import connect
from onpolicy.services.common.server import ServerConfig
from onpolicy.services.controller.controller import JobController
from onpolicy.services.controller.servicer import jobs_server
from onpolicy.services.roles import TrainerOptions, VerifierOptions, start_role
from onpolicy.verification.config import VerifierConfig

TOKEN = "fuzz-services-token"
KV16 = KernelConfig(kv_tile=16)
FUZZ = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
SOME = settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
TEXT = st.one_of(st.text(max_size=40), st.sampled_from(["", "\x00", "../../etc/passwd", "x" * 5000, "🙂", "%s%n"]))
pytestmark = pytest.mark.filterwarnings("ignore:Generating overly large repr")


class NoCluster:
    """A launcher without a cluster: every job it is asked to start fails with this error."""

    @contextlib.contextmanager
    def launch(self, job_id, spec, job_dir=None, notify=None):
        raise RuntimeError("no cluster in this test")
        yield


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("fuzz")
    started = {"trainer": start_role(TrainerOptions(model="tiny-qwen3", kernels=KV16), token=TOKEN).server,
               "verifier": start_role(VerifierOptions(model="tiny-qwen3", kernels=KV16, verifier=VerifierConfig(
                   mismatch_dir=str(tmp / "mismatches"))), token=TOKEN).server}
    started["jobs"] = jobs_server(JobController(tmp / "controller", NoCluster()), ServerConfig(port=0, token=TOKEN))
    yield {r: connect(s.address, token=TOKEN) for r, s in started.items()}, tmp
    for s in started.values():
        s.stop(grace=0)


COMPLETIONS = st.builds(
    lambda p, t, lp, temp, version: api.common_pb2.Completion(prompt_ids=p, token_ids=t, logprobs=lp,
                                                              temperature=temp, weight_version=version),
    IDS, IDS, st.lists(FLOATS, max_size=40), FLOATS, INT64)
PLAUSIBLE = st.integers(1, 8).flatmap(lambda k: st.builds(
    lambda p, t, lp, temp: api.common_pb2.Completion(prompt_ids=p, token_ids=t, logprobs=lp, temperature=temp),
    st.lists(st.integers(0, 319), min_size=1, max_size=12), st.lists(st.integers(0, 319), min_size=k, max_size=k),
    st.lists(st.floats(-30.0, 0.0, width=32), min_size=k, max_size=k), st.sampled_from([1.0, 0.7])))
"""Completions that pass validation, so the recompute path itself is exercised."""
COMPLETIONS = st.one_of(COMPLETIONS, PLAUSIBLE)
SAMPLES = st.builds(lambda job, step, c, fp, src: api.verifier_pb2.Sample(job_id=job, step=step, completion=c,
                                                                          kernel_fingerprint=fp, source=src),
                    TEXT, INT64, COMPLETIONS, TEXT, st.sampled_from(["", "onpolicy", "vllm", "bogus"]))


@FUZZ
@given(samples=st.lists(SAMPLES, max_size=4), wait=st.booleans())
def test_submit_samples_fuzz(servers, samples, wait) -> None:
    channels, _ = servers
    stub = api.verifier_pb2_grpc.VerifierServiceStub(channels["verifier"])
    call_ok_or_allowed(lambda: stub.SubmitSamples(api.verifier_pb2.SubmitSamplesRequest(samples=samples, wait=wait),
                                                  timeout=120))
    call_ok_or_allowed(lambda: stub.GetReport(api.verifier_pb2.GetReportRequest(job_id=samples[0].job_id if samples
                                                                                else ""), timeout=30))
    still_serving(channels["verifier"])


@SOME
@given(sample=SAMPLES, rollout=TEXT, trainer=st.one_of(TEXT, st.sampled_from(["kernels=fast", "kv_tile=-1",
                                                                                 "dtype=fp8", "weights=/nonexistent",
                                                                                 "temperature=nan", "=,=,"])))
def test_diagnose_fuzz(servers, sample, rollout, trainer) -> None:
    channels, _ = servers
    stub = api.verifier_pb2_grpc.VerifierServiceStub(channels["verifier"])
    req = api.verifier_pb2.DiagnoseRequest(sample=sample, rollout_options=rollout, trainer_options=trainer)
    call_ok_or_allowed(lambda: stub.Diagnose(req, timeout=120))
    still_serving(channels["verifier"])


@FUZZ
@given(path=TEXT, sha=TEXT, version=INT64, fp=TEXT)
def test_verifier_update_weights_fuzz(servers, path, sha, version, fp) -> None:
    channels, _ = servers
    stub = api.verifier_pb2_grpc.VerifierServiceStub(channels["verifier"])
    before = stub.GetInfo(api.verifier_pb2.VerifierServiceGetInfoRequest(), timeout=30).info
    ref = api.common_pb2.WeightsRef(path=path, sha256=sha, version=version, kernel_fingerprint=fp)
    with pytest.raises(grpc.RpcError) as e:
        stub.UpdateWeights(api.verifier_pb2.VerifierServiceUpdateWeightsRequest(weights=ref), timeout=60)
    assert e.value.code() in ALLOWED
    after = stub.GetInfo(api.verifier_pb2.VerifierServiceGetInfoRequest(), timeout=30).info
    assert (after.weight_sha256, after.weight_version) == (before.weight_sha256, before.weight_version)


def test_wrong_fingerprint_and_sha_of_a_real_weight_file_are_refused(servers) -> None:
    channels, tmp = servers
    trainer = api.trainer_pb2_grpc.TrainerServiceStub(channels["trainer"])
    verifier = api.verifier_pb2_grpc.VerifierServiceStub(channels["verifier"])
    ref = trainer.ExportWeights(api.trainer_pb2.ExportWeightsRequest(directory=str(tmp / "w")), timeout=60).weights
    for field, value in (("kernel_fingerprint", "reference-r8-kv16-fp32-v2-00000000"), ("sha256", "0" * 64),
                         ("version", ref.version + 1)):
        bad = api.common_pb2.WeightsRef()
        bad.CopyFrom(ref)
        setattr(bad, field, value)
        with pytest.raises(grpc.RpcError) as e:
            verifier.UpdateWeights(api.verifier_pb2.VerifierServiceUpdateWeightsRequest(weights=bad), timeout=60)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT, field
    verifier.UpdateWeights(api.verifier_pb2.VerifierServiceUpdateWeightsRequest(weights=ref), timeout=60)


@FUZZ
@given(name=st.one_of(TEXT, st.sampled_from(["w", "c", "c/step-000000", "nope"])), extra=TEXT)
def test_trainer_export_checkpoint_restore_fuzz(servers, name, extra) -> None:
    channels, tmp = servers
    stub = api.trainer_pb2_grpc.TrainerServiceStub(channels["trainer"])
    directory = name if not name or "\x00" in name else str(tmp / "t" / name.replace("/", "_"))
    call_ok_or_allowed(lambda: stub.ExportWeights(api.trainer_pb2.ExportWeightsRequest(directory=directory),
                                                  timeout=60))
    call_ok_or_allowed(lambda: stub.SaveCheckpoint(
        api.trainer_pb2.SaveCheckpointRequest(directory=directory, extra_json=extra), timeout=60))
    call_ok_or_allowed(lambda: stub.RestoreCheckpoint(api.trainer_pb2.RestoreCheckpointRequest(directory=directory),
                                                      timeout=60))
    stub.GetInfo(api.trainer_pb2.TrainerServiceGetInfoRequest(), timeout=30)
    still_serving(channels["trainer"])


SPEC_FIELDS = st.fixed_dictionaries({}, optional={
    "model": TEXT, "steps": st.one_of(INT32, st.integers(-2, 3)), "seed": INT64,
    "grpo": st.fixed_dictionaries({}, optional={"lr": FLOATS, "group_size": INT32, "clip_eps_low": FLOATS,
                                                "kl_estimator": TEXT, "loss_agg": TEXT, "grad_clip": FLOATS}),
    "rollout": st.fixed_dictionaries({}, optional={"temperature": FLOATS, "max_new_tokens": INT32, "kernels": TEXT}),
    "kernels": st.fixed_dictionaries({}, optional={"backend": TEXT, "dtype": TEXT, "kv_tile": INT32}),
    "dataset": st.fixed_dictionaries({}, optional={"kind": TEXT, "path": TEXT, "size": INT32}),
    "checkpoint": st.fixed_dictionaries({}, optional={"dir": TEXT, "interval": INT32}),
})


def _spec_message(fields: dict, rewards: list[tuple[str, float]], roles: dict[str, float]):
    msg = api.jobs_pb2.JobSpec()
    for key, value in fields.items():
        if isinstance(value, dict):
            for k, v in value.items():
                setattr(getattr(msg, key), k, v)
        else:
            setattr(msg, key, value)
    for name, weight in rewards:
        msg.rewards.add(name=name, weight=weight)
    for role, cpus in roles.items():
        msg.resources[role].cpus = cpus
    return msg


@FUZZ
@given(fields=SPEC_FIELDS, rewards=st.lists(st.tuples(st.one_of(TEXT, st.just("exact_answer")), FLOATS), max_size=3),
       roles=st.dictionaries(st.one_of(TEXT, st.just("trainer")), FLOATS, max_size=2), job_id=TEXT)
def test_job_service_fuzz(servers, fields, rewards, roles, job_id) -> None:
    channels, _ = servers
    stub = api.jobs_pb2_grpc.JobServiceStub(channels["jobs"])
    submitted: list[str] = []

    def submit() -> None:
        submitted.append(stub.SubmitJob(api.jobs_pb2.SubmitJobRequest(spec=_spec_message(fields, rewards, roles)),
                                        timeout=30).job.job_id)

    call_ok_or_allowed(submit)
    for call in job_calls(stub, job_id):
        call_ok_or_allowed(call)
    for accepted in submitted:  # a valid spec: the job ends cleanly (no cluster here), with its error
        events = [r.event for r in stub.WatchJob(api.jobs_pb2.WatchJobRequest(job_id=accepted), timeout=60)]
        assert api.jobs_pb2.JobState.Name(events[-1].state) == "JOB_STATE_FAILED"
        assert "no cluster in this test" in events[-1].message
    stub.ListJobs(api.jobs_pb2.ListJobsRequest(), timeout=30)
    still_serving(channels["jobs"])


def job_calls(stub, job_id: str) -> list:
    """GetJob, CancelJob and WatchJob of ``job_id``, each as a no-argument call."""
    return [lambda: stub.GetJob(api.jobs_pb2.GetJobRequest(job_id=job_id), timeout=30),
            lambda: stub.CancelJob(api.jobs_pb2.CancelJobRequest(job_id=job_id), timeout=30),
            lambda: list(stub.WatchJob(api.jobs_pb2.WatchJobRequest(job_id=job_id), timeout=30))]


def test_unknown_and_empty_job_ids(servers) -> None:
    channels, _ = servers
    stub = api.jobs_pb2_grpc.JobServiceStub(channels["jobs"])
    for job_id, code in (("nope", grpc.StatusCode.NOT_FOUND), ("", grpc.StatusCode.INVALID_ARGUMENT),
                         ("../" * 50, grpc.StatusCode.NOT_FOUND)):
        for call in job_calls(stub, job_id):
            with pytest.raises(grpc.RpcError) as e:
                call()
            assert e.value.code() == code
