"""RolloutService over real gRPC (127.0.0.1, port 0) on ``tiny-qwen3``: streamed completions carry
the trainer's logprobs bit for bit, concurrent calls equal sequential ones, bad requests name their
field, and weight updates are verified before they replace anything."""

from __future__ import annotations

import dataclasses
import math
import os
import threading
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
import torch

from onpolicy.kernels import KernelConfig
from onpolicy.kernels.selftest import SelftestReport
from onpolicy.models.loading import weights_sha256
from onpolicy.rollout import EngineConfig
from onpolicy.services import api
from onpolicy.services.common import model as service_model
from onpolicy.services.common.client import connect, field_violations
from onpolicy.services.common.server import GrpcServer, ServerConfig
from onpolicy.services.roles import serve_servicer
from onpolicy.services.rollout import RolloutServicer, UncertifiedBackend, build_rollout_service
from onpolicy.trainer.forward import ScoredSequence, sequence_logprobs
from onpolicy.weights import WeightsRef, export_weights

pb = api.rollout_pb2
MODEL = "tiny-qwen3"
KERNELS = KernelConfig(kv_tile=16)
TOKEN = "rollout-test-token"
PROMPTS = [pb.Prompt(prompt_ids=[5, 9, 17]), pb.Prompt(prompt_ids=list(range(30, 70))),
           pb.Prompt(text="What is 2 + 2?")]
PARAMS = pb.SamplingParams(temperature=0.8, max_new_tokens=12, n=2, seed=11, ignore_eos=True)


@pytest.fixture(scope="module")
def home(tmp_path_factory: pytest.TempPathFactory, tiny_paths: dict[str, Path]) -> Iterator[Path]:
    """A private ONPOLICY_HOME (the service writes its self-test certificate) sharing the model cache."""
    home = tmp_path_factory.mktemp("onpolicy-home")
    (home / "models").symlink_to(Path(os.environ["ONPOLICY_HOME"]) / "models", target_is_directory=True)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("ONPOLICY_HOME", str(home))
        yield home


@pytest.fixture(scope="module")
def service(home: Path) -> Iterator[tuple[RolloutServicer, GrpcServer]]:
    servicer = build_rollout_service(MODEL, KERNELS, EngineConfig(kv_cache_tokens=1024, max_num_seqs=8))
    server = serve_servicer("rollout", servicer, ServerConfig(token=TOKEN))
    yield servicer, server
    server.stop(0)


@pytest.fixture(scope="module")
def rollout(service: tuple[RolloutServicer, GrpcServer]) -> Iterator[api.rollout_pb2_grpc.RolloutServiceStub]:
    with connect(service[1].address, token=TOKEN) as ch:
        yield api.rollout_pb2_grpc.RolloutServiceStub(ch)


def generate(stub: api.rollout_pb2_grpc.RolloutServiceStub, prompts: list[pb.Prompt] = PROMPTS,
             params: pb.SamplingParams = PARAMS) -> dict[tuple[int, int], api.common_pb2.Completion]:
    out = {}
    for r in stub.Generate(pb.GenerateRequest(prompts=prompts, params=params), timeout=60):
        key = (r.completion.prompt_index, r.completion.sample_index)
        assert key not in out
        out[key] = r.completion
    return out


def trainer_logprobs(servicer: RolloutServicer, c: api.common_pb2.Completion) -> list[float]:
    seq = ScoredSequence(tuple(c.prompt_ids), tuple(c.token_ids), c.temperature)
    return sequence_logprobs(servicer.lm.model, [seq])[0].tolist()


def info(stub: api.rollout_pb2_grpc.RolloutServiceStub) -> api.common_pb2.ServiceInfo:
    return stub.GetInfo(pb.RolloutServiceGetInfoRequest(), timeout=10).info


def test_get_info(service: tuple[RolloutServicer, GrpcServer], rollout: api.rollout_pb2_grpc.RolloutServiceStub,
                  ) -> None:
    servicer, _ = service
    i = info(rollout)
    assert (i.service, i.model, i.kernel_fingerprint) == ("rollout", MODEL, KERNELS.fingerprint)
    assert i.kernel_config.kv_tile == 16 and i.kernel_config.backend == "reference"
    assert i.weight_sha256 == weights_sha256(servicer.lm.model.state_dict()) and i.weight_version == 0
    assert i.certified and i.version


def test_generate_streams_trainer_logprobs_bit_for_bit(service: tuple[RolloutServicer, GrpcServer],
                                                       rollout: api.rollout_pb2_grpc.RolloutServiceStub) -> None:
    servicer, _ = service
    got = generate(rollout)
    assert sorted(got) == [(p, s) for p in range(len(PROMPTS)) for s in range(PARAMS.n)]
    tok = servicer.lm.tokenizer
    for (p, _), c in got.items():
        assert len(c.token_ids) == PARAMS.max_new_tokens == len(c.logprobs) and c.finish_reason == "length"
        expected_prompt = PROMPTS[p].prompt_ids or tok.encode(tok.chat_prompt(PROMPTS[p].text))
        assert list(c.prompt_ids) == list(expected_prompt)
        assert c.text == tok.decode(list(c.token_ids))
        assert list(c.logprobs) == trainer_logprobs(servicer, c)  # exact float equality


def test_concurrent_calls_equal_sequential_calls(rollout: api.rollout_pb2_grpc.RolloutServiceStub) -> None:
    requests = [([PROMPTS[i % 3], pb.Prompt(prompt_ids=[i + 1] * (3 + 7 * i))],
                 pb.SamplingParams(temperature=0.5 + 0.25 * i, max_new_tokens=6 + 3 * i, n=1 + i % 2, seed=i))
                for i in range(5)]
    sequential = [generate(rollout, *r) for r in requests]
    concurrent: list[dict | None] = [None] * len(requests)
    barrier = threading.Barrier(len(requests))

    def call(i: int) -> None:
        barrier.wait()
        concurrent[i] = generate(rollout, *requests[i])

    threads = [threading.Thread(target=call, args=(i,)) for i in range(len(requests))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert concurrent == sequential


BAD_REQUESTS = [
    ([], PARAMS, "prompts"),
    ([pb.Prompt()], PARAMS, "prompts[0].prompt_ids"),
    ([pb.Prompt(prompt_ids=[1]), pb.Prompt(prompt_ids=[2, 320])], PARAMS, "prompts[1].prompt_ids"),
    ([pb.Prompt(prompt_ids=[-1])], PARAMS, "prompts[0].prompt_ids"),
    ([pb.Prompt(prompt_ids=[1], text="both")], PARAMS, "prompts[0]"),
    ([pb.Prompt(prompt_ids=[1] * 1020)], PARAMS, "prompts[0].prompt_ids"),  # + 12 new tokens > the KV cache
    (PROMPTS, pb.SamplingParams(temperature=math.nan, max_new_tokens=4), "params.temperature"),
    (PROMPTS, pb.SamplingParams(temperature=-0.5, max_new_tokens=4), "params.temperature"),
    (PROMPTS, pb.SamplingParams(temperature=1.0, max_new_tokens=0), "params.max_new_tokens"),
    (PROMPTS, pb.SamplingParams(temperature=1.0), "params.max_new_tokens"),
    (PROMPTS, pb.SamplingParams(max_new_tokens=4, n=-2), "params.n"),
    (PROMPTS, pb.SamplingParams(max_new_tokens=4, stop_token_ids=[3, 400]), "params.stop_token_ids[1]"),
]


def test_bad_requests_name_the_field_and_the_server_keeps_serving(
        rollout: api.rollout_pb2_grpc.RolloutServiceStub) -> None:
    before = generate(rollout, PROMPTS[:1])
    for prompts, params, field in BAD_REQUESTS:
        with pytest.raises(grpc.RpcError) as e:
            generate(rollout, prompts, params)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT, field
        assert [f for f, _ in field_violations(e.value)] == [field]
    with pytest.raises(grpc.RpcError) as e:  # too many sequences in one request
        generate(rollout, [PROMPTS[0]] * 100, pb.SamplingParams(max_new_tokens=1, n=50))
    assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert generate(rollout, PROMPTS[:1]) == before


def test_cancelled_and_timed_out_calls_leave_the_server_serving(
        rollout: api.rollout_pb2_grpc.RolloutServiceStub) -> None:
    long = pb.GenerateRequest(prompts=PROMPTS[:1], params=pb.SamplingParams(max_new_tokens=300, ignore_eos=True))
    stream = rollout.Generate(long, timeout=60)
    stream.cancel()
    with pytest.raises(grpc.RpcError) as e:
        list(rollout.Generate(long, timeout=0.2))  # ~1 s of decoding
    assert e.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert len(generate(rollout, PROMPTS[:1])) == PARAMS.n


def _update(stub: api.rollout_pb2_grpc.RolloutServiceStub, ref: WeightsRef) -> pb.UpdateWeightsResponse:
    return stub.UpdateWeights(pb.UpdateWeightsRequest(weights=api.common_pb2.WeightsRef(
        path=ref.path, sha256=ref.sha256, version=ref.version, kernel_fingerprint=ref.kernel_fingerprint)),
        timeout=60)


def test_weight_updates_are_verified_and_change_the_logprobs(
        service: tuple[RolloutServicer, GrpcServer], rollout: api.rollout_pb2_grpc.RolloutServiceStub,
        tmp_path: Path) -> None:
    servicer, _ = service
    original = {k: v.clone() for k, v in servicer.lm.model.state_dict().items()}
    base_info, base = info(rollout), generate(rollout)
    modified = {k: v * 1.05 if v.ndim == 2 else v for k, v in original.items()}
    good = export_weights(modified, tmp_path, 7, KERNELS.fingerprint, MODEL)
    refusals = [
        (dict(sha256="0" * 64), grpc.StatusCode.INVALID_ARGUMENT, "weights.sha256"),
        (dict(sha256="not-hex"), grpc.StatusCode.INVALID_ARGUMENT, "weights.sha256"),
        (dict(kernel_fingerprint=KernelConfig(kv_tile=32).fingerprint), grpc.StatusCode.INVALID_ARGUMENT,
         "weights.kernel_fingerprint"),
        (dict(path=str(tmp_path / "missing.safetensors")), grpc.StatusCode.NOT_FOUND, None),
    ]
    wrong_model = export_weights({"x": torch.zeros(2)}, tmp_path / "other", 9, KERNELS.fingerprint, "other")
    for changes, code, field in refusals:
        with pytest.raises(grpc.RpcError) as e:
            _update(rollout, dataclasses.replace(good, **changes))
        assert e.value.code() == code
        assert [f for f, _ in field_violations(e.value)] == ([field] if field else [])
    with pytest.raises(grpc.RpcError) as e:
        _update(rollout, wrong_model)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and field_violations(e.value)[0][0] == "weights"
    assert info(rollout) == base_info and generate(rollout) == base  # refusals kept the old weights

    reply = _update(rollout, good)
    new_info = info(rollout)
    assert reply.weight_version == new_info.weight_version == 7
    assert reply.weight_sha256 == new_info.weight_sha256 == weights_sha256(servicer.lm.model.state_dict())
    assert new_info.weight_sha256 != base_info.weight_sha256
    updated = generate(rollout)
    for key, c in updated.items():
        assert c.weight_version == 7 and c.logprobs != base[key].logprobs
        assert list(c.logprobs) == trainer_logprobs(servicer, c)

    restore = export_weights(original, tmp_path, 8, KERNELS.fingerprint, MODEL)  # back to the start
    assert _update(rollout, restore).weight_sha256 == base_info.weight_sha256
    again = generate(rollout)
    assert all(again[k].logprobs == base[k].logprobs and again[k].token_ids == base[k].token_ids for k in base)


def test_an_uncertified_backend_is_refused(home: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    config = KernelConfig(kv_tile=16, row_tile=4)  # no certificate in this home yet

    def failing_selftest(kernels: KernelConfig, shapes: object, progress: object = None) -> SelftestReport:
        from onpolicy.kernels.selftest import ProbeResult

        return SelftestReport(kernels.backend, kernels.fingerprint, shapes, {},  # type: ignore[arg-type]
                              [ProbeResult("linear/qkv", False, 1, "batch 3")])

    monkeypatch.setattr(service_model, "run_selftest", failing_selftest)
    with pytest.raises(UncertifiedBackend, match="linear/qkv"):
        build_rollout_service(MODEL, config)


def test_stopping_the_server_stops_the_engine_thread(home: Path) -> None:
    servicer = build_rollout_service(MODEL, KERNELS, EngineConfig(kv_cache_tokens=1024))
    server = serve_servicer("rollout", servicer)
    with connect(server.address) as ch:
        stub = api.rollout_pb2_grpc.RolloutServiceStub(ch)
        stream = stub.Generate(pb.GenerateRequest(prompts=PROMPTS[:1], params=pb.SamplingParams(
            max_new_tokens=300, ignore_eos=True)), timeout=30)
        server.stop(0)
        with pytest.raises(grpc.RpcError) as e:
            list(stream)
        assert e.value.code() in (grpc.StatusCode.CANCELLED, grpc.StatusCode.UNAVAILABLE)
    assert not servicer.worker.alive
