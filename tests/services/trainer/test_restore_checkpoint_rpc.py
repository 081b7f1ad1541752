"""TrainerService.RestoreCheckpoint on a real gRPC server: a trainer that trained on goes back to the
checkpoint bitwise (weights sha256, step, the controller's extra JSON); no checkpoint is NOT_FOUND;
a corrupt one is FAILED_PRECONDITION and changes nothing."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import pytest

from onpolicy.models.loading import LoadedModel
from onpolicy.rollout import EngineConfig, RolloutEngine, SamplingParams
from onpolicy.services import api
from onpolicy.services.common.client import connect
from onpolicy.services.common.server import ServerConfig
from onpolicy.services.roles import serve_servicer
from onpolicy.services.trainer.servicer import TrainerServicer
from onpolicy.trainer.engine import TrainerEngine

pb = api.trainer_pb2
MODEL = "tiny-qwen3"


@pytest.fixture
def trainer(load_tiny: Callable[..., LoadedModel]) -> Iterator[tuple[object, list[object]]]:
    lm = load_tiny(MODEL, fresh=True)
    comps = RolloutEngine(lm, EngineConfig(kv_cache_tokens=256)).generate(
        [[1, 2, 3, 4]], SamplingParams(temperature=1.0, max_new_tokens=6, n=2, seed=3, ignore_eos=True))
    server = serve_servicer("trainer", TrainerServicer(TrainerEngine(load_tiny(MODEL, fresh=True))),
                            ServerConfig(host="127.0.0.1", port=0))
    channel = connect(server.address)
    try:
        yield api.trainer_pb2_grpc.TrainerServiceStub(channel), comps
    finally:
        channel.close()
        server.stop(grace=0)


def train(stub, comps) -> None:
    stub.TrainStep(pb.TrainStepRequest(
        samples=[pb.TrainSample(prompt_ids=c.prompt_ids, token_ids=c.token_ids, old_logprobs=c.logprobs,
                                advantage=a, temperature=c.temperature)
                 for c, a in zip(comps, (1.0, -1.0), strict=True)],
        loss=pb.LossConfig(clip_eps_low=0.2, clip_eps_high=0.28, kl_estimator="k3", loss_agg="token-mean",
                           epochs=1, minibatches=1),
        optimizer=pb.OptimizerConfig(lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8, grad_clip=1.0)), timeout=120)


def info(stub) -> tuple[int, str]:
    r = stub.GetInfo(pb.TrainerServiceGetInfoRequest(), timeout=30)
    return r.step, r.info.weight_sha256


def test_restore_goes_back_to_the_checkpoint_bitwise(trainer, tmp_path: Path) -> None:
    stub, comps = trainer
    train(stub, comps)
    extra = json.dumps({"job_id": "j", "step": 1})
    stub.SaveCheckpoint(pb.SaveCheckpointRequest(directory=str(tmp_path), extra_json=extra), timeout=60)
    saved = info(stub)
    train(stub, comps)
    trained_on = info(stub)
    assert trained_on != saved
    r = stub.RestoreCheckpoint(pb.RestoreCheckpointRequest(directory=str(tmp_path)), timeout=60)
    assert (r.step, r.extra_json, Path(r.path).name) == (1, extra, "step-000001")
    assert info(stub) == saved
    train(stub, comps)  # trains on exactly as before: same weights, optimizer moments and RNG
    assert info(stub) == trained_on
    stub.RestoreCheckpoint(pb.RestoreCheckpointRequest(directory=r.path), timeout=60)  # a step directory
    assert info(stub) == saved


def test_missing_and_corrupt_checkpoints_are_refused_and_change_nothing(trainer, tmp_path: Path) -> None:
    stub, comps = trainer
    with pytest.raises(grpc.RpcError) as e:
        stub.RestoreCheckpoint(pb.RestoreCheckpointRequest(directory=str(tmp_path / "none")), timeout=30)
    assert e.value.code() == grpc.StatusCode.NOT_FOUND
    with pytest.raises(grpc.RpcError) as e:
        stub.RestoreCheckpoint(pb.RestoreCheckpointRequest(directory=""), timeout=30)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    stub.SaveCheckpoint(pb.SaveCheckpointRequest(directory=str(tmp_path)), timeout=60)
    train(stub, comps)
    before = info(stub)
    weights = tmp_path / "step-000000" / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 1
    weights.write_bytes(bytes(data))
    with pytest.raises(grpc.RpcError) as e:
        stub.RestoreCheckpoint(pb.RestoreCheckpointRequest(directory=str(tmp_path)), timeout=30)
    assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION and "sha256" in e.value.details()
    assert info(stub) == before
