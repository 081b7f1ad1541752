"""Property-based fuzzing of the rollout and trainer RPCs with malformed and extreme values: only
proper status codes come back, and the service stays healthy and keeps serving."""

from __future__ import annotations

import math

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from onpolicy.kernels import KernelConfig
from onpolicy.rollout import EngineConfig
from onpolicy.services import api
from onpolicy.services.common.client import connect
from onpolicy.services.roles import RolloutOptions, TrainerOptions, start_role

TOKEN = "fuzz-token"
KV16 = KernelConfig(kv_tile=16)
ALLOWED = {grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.RESOURCE_EXHAUSTED,
           grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.NOT_FOUND, grpc.StatusCode.OUT_OF_RANGE}
INT32 = st.integers(-(2**31), 2**31 - 1)
INT64 = st.integers(-(2**63), 2**63 - 1)
FLOATS = st.one_of(st.floats(allow_nan=True, allow_infinity=True, width=32),
                   st.sampled_from([0.0, -0.0, 1.0, -1.0, 1e-30, 3.4e38, math.nan, math.inf, -math.inf]))
IDS = st.one_of(st.lists(st.integers(0, 319), max_size=40), st.lists(INT32, max_size=8),
                st.just([1] * 5000), st.just([]))
pytestmark = pytest.mark.filterwarnings("ignore:Generating overly large repr")
FUZZ = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


@pytest.fixture(scope="module")
def servers():
    started = {"rollout": start_role(RolloutOptions(model="tiny-qwen3", kernels=KV16, engine_config=EngineConfig(
                   max_num_seqs=8, max_batched_tokens=256)), token=TOKEN).server,
               "trainer": start_role(TrainerOptions(model="tiny-qwen3", kernels=KV16), token=TOKEN).server}
    yield {r: connect(s.address, token=TOKEN) for r, s in started.items()}
    for s in started.values():
        s.stop(grace=0)


def call_ok_or_allowed(fn) -> None:
    try:
        fn()
    except grpc.RpcError as e:
        assert e.code() in ALLOWED, f"{e.code()}: {e.details()}"


def still_serving(channel: grpc.Channel) -> None:
    status = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10).status
    assert status == health_pb2.HealthCheckResponse.SERVING


@FUZZ
@given(prompts=st.lists(st.tuples(IDS, st.one_of(st.just(""), st.text(max_size=30))), max_size=4),
       temperature=FLOATS, max_new=st.one_of(st.integers(-3, 12), INT32), n=st.one_of(st.integers(-2, 4), INT32),
       seed=INT64, stops=st.lists(INT32, max_size=3), ignore_eos=st.booleans())
def test_generate_fuzz(servers, prompts, temperature, max_new, n, seed, stops, ignore_eos) -> None:
    stub = api.rollout_pb2_grpc.RolloutServiceStub(servers["rollout"])
    req = api.rollout_pb2.GenerateRequest(
        prompts=[api.rollout_pb2.Prompt(prompt_ids=ids, text=text) for ids, text in prompts],
        params=api.rollout_pb2.SamplingParams(temperature=temperature, max_new_tokens=max_new, n=n, seed=seed,
                                              stop_token_ids=stops, ignore_eos=ignore_eos))
    call_ok_or_allowed(lambda: list(stub.Generate(req, timeout=120)))
    still_serving(servers["rollout"])


@FUZZ
@given(samples=st.lists(st.tuples(IDS, IDS, st.lists(FLOATS, max_size=40), FLOATS, FLOATS), max_size=3),
       lr=FLOATS, clip_low=FLOATS, clip_high=FLOATS, epochs=st.integers(-2, 2), minibatches=st.integers(-2, 4),
       agg=st.sampled_from(["", "token-mean", "seq-mean", "bogus"]), est=st.sampled_from(["", "k1", "k3", "k9"]),
       kl=FLOATS, grad_clip=FLOATS)
def test_train_step_fuzz(servers, samples, lr, clip_low, clip_high, epochs, minibatches, agg, est, kl,
                         grad_clip) -> None:
    stub = api.trainer_pb2_grpc.TrainerServiceStub(servers["trainer"])
    req = api.trainer_pb2.TrainStepRequest(
        samples=[api.trainer_pb2.TrainSample(prompt_ids=p, token_ids=t, old_logprobs=lp, advantage=a, temperature=tp)
                 for p, t, lp, a, tp in samples],
        loss=api.trainer_pb2.LossConfig(clip_eps_low=clip_low, clip_eps_high=clip_high, kl_coef=kl, kl_estimator=est,
                                        loss_agg=agg, epochs=epochs, minibatches=minibatches),
        optimizer=api.trainer_pb2.OptimizerConfig(lr=lr, beta1=0.9, beta2=0.999, eps=1e-8, grad_clip=grad_clip))
    call_ok_or_allowed(lambda: stub.TrainStep(req, timeout=120))
    still_serving(servers["trainer"])


@FUZZ
@given(seqs=st.lists(st.tuples(IDS, IDS, FLOATS), max_size=4), pack=INT32)
def test_compute_logprobs_fuzz(servers, seqs, pack) -> None:
    stub = api.trainer_pb2_grpc.TrainerServiceStub(servers["trainer"])
    req = api.trainer_pb2.ComputeLogprobsRequest(
        sequences=[api.common_pb2.ScoredSequence(prompt_ids=p, token_ids=t, temperature=tp) for p, t, tp in seqs],
        pack_tokens=pack)
    call_ok_or_allowed(lambda: stub.ComputeLogprobs(req, timeout=120))
    still_serving(servers["trainer"])


@FUZZ
@given(path=st.text(max_size=60), sha=st.text(max_size=70), version=INT64, fp=st.text(max_size=40))
def test_update_weights_fuzz(servers, path, sha, version, fp) -> None:
    stub = api.rollout_pb2_grpc.RolloutServiceStub(servers["rollout"])
    before = stub.GetInfo(api.rollout_pb2.RolloutServiceGetInfoRequest()).info
    ref = api.common_pb2.WeightsRef(path=path, sha256=sha, version=version, kernel_fingerprint=fp)
    with pytest.raises(grpc.RpcError) as e:  # nothing random is a valid weight version
        stub.UpdateWeights(api.rollout_pb2.UpdateWeightsRequest(weights=ref), timeout=60)
    assert e.value.code() in ALLOWED
    after = stub.GetInfo(api.rollout_pb2.RolloutServiceGetInfoRequest()).info
    assert after.weight_sha256 == before.weight_sha256 and after.weight_version == before.weight_version


def test_oversized_message_is_refused_and_service_keeps_serving(servers) -> None:
    stub = api.rollout_pb2_grpc.RolloutServiceStub(servers["rollout"])
    huge = api.rollout_pb2.GenerateRequest(prompts=[api.rollout_pb2.Prompt(text="x" * (65 * 1024 * 1024))])
    with pytest.raises(grpc.RpcError) as e:
        list(stub.Generate(huge, timeout=60))
    assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    still_serving(servers["rollout"])
