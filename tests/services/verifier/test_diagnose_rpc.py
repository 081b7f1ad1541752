"""VerifierService.Diagnose: the doctor behind the verifier's gRPC API."""

from __future__ import annotations

import json

import grpc
import pytest

from onpolicy.kernels import KernelConfig, get_backend
from onpolicy.models.registry import load_model
from onpolicy.rollout import EngineConfig, RolloutEngine, SamplingParams
from onpolicy.services import api
from onpolicy.services.common.client import connect, field_violations
from onpolicy.services.common.convert import completion_to_proto
from onpolicy.services.roles import VerifierOptions, start_role

KV16 = KernelConfig(kv_tile=16)


@pytest.fixture(scope="module")
def verifier():
    server = start_role(VerifierOptions(model="tiny-qwen3", kernels=KV16)).server
    yield api.verifier_pb2_grpc.VerifierServiceStub(connect(server.address))
    server.stop(grace=0)


def sample(backend: str) -> object:
    lm = load_model("tiny-qwen3", get_backend(KernelConfig(backend=backend, kv_tile=16)))
    comp = RolloutEngine(lm, EngineConfig(kv_cache_tokens=512)).generate(
        [[3, 1, 4, 1, 5, 9, 2, 6, 5, 3] * 2], SamplingParams(max_new_tokens=12, seed=2, ignore_eos=True))[0]
    return api.verifier_pb2.Sample(job_id="j", step=0, completion=completion_to_proto(comp), source="onpolicy",
                                   kernel_fingerprint=lm.model.ops.fingerprint)


def test_consistent_sample_has_no_divergence(verifier) -> None:
    r = verifier.Diagnose(api.verifier_pb2.DiagnoseRequest(sample=sample("reference")), timeout=300)
    assert not r.divergent and r.fault_class == "none" and r.max_abs_logdiff == 0.0
    assert json.loads(r.report_json)["class"] == "none"


def test_fast_rollout_is_an_operator_fault(verifier) -> None:
    r = verifier.Diagnose(api.verifier_pb2.DiagnoseRequest(sample=sample("fast"), rollout_options="kernels=fast"),
                          timeout=300)
    # the first op that differs: RMSNorm (the reference sums squares in rowdot's order, fast in torch's)
    assert r.divergent and r.fault_class == "operator" and r.op == "rmsnorm" and r.layer == 0
    # whether the operator drift reaches this one sequence's logprobs depends on the CPU's GEMM
    # kernels (it does with AVX-512, not on an AVX2 machine); the doctor says which
    assert r.max_abs_logdiff > 0 or "did not reach this sequence's token logprobs" in r.report_json


def test_bad_options_name_the_field(verifier) -> None:
    with pytest.raises(grpc.RpcError) as e:
        verifier.Diagnose(api.verifier_pb2.DiagnoseRequest(sample=sample("reference"), trainer_options="bogus=1"))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "trainer_options" in [f for f, _ in field_violations(e.value)]
