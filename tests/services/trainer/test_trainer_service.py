"""TrainerService on a real gRPC server (127.0.0.1, port 0): logprobs bitwise equal to the
in-process training forward, train steps, weight export, checkpoints, field-named refusals, and the
certification gate of ``build_trainer_service``."""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import pytest
import torch

from onpolicy.models.loading import LoadedModel
from onpolicy.rollout import EngineConfig, RolloutEngine, SamplingParams
from onpolicy.services import api
from onpolicy.services.common.client import connect, field_violations
from onpolicy.services.common.server import ServerConfig
from onpolicy.services.roles import serve_servicer
from onpolicy.services.trainer.servicer import TrainerServicer
from onpolicy.trainer.checkpoint import load_checkpoint
from onpolicy.trainer.engine import TrainerEngine
from onpolicy.trainer.forward import ScoredSequence, sequence_logprobs
from onpolicy.trainer.grpo import group_advantages
from onpolicy.weights import WeightsRef, file_sha256, load_weights

pb = api.trainer_pb2
MODEL = "tiny-qwen3"
PROMPTS = [[1, 2, 3, 4, 5], [60, 61, 62, 63, 64, 65, 66, 67, 68, 69, 70, 71, 72, 73, 74, 75, 76, 77]]


@pytest.fixture(scope="module")
def completions(load_tiny: Callable[..., LoadedModel]) -> list[object]:
    engine = RolloutEngine(load_tiny(MODEL), EngineConfig(kv_cache_tokens=512))
    return engine.generate(PROMPTS, SamplingParams(temperature=0.9, max_new_tokens=8, n=2, seed=5, ignore_eos=True))


@pytest.fixture
def served(load_tiny: Callable[..., LoadedModel]) -> Iterator[tuple[api.trainer_pb2_grpc.TrainerServiceStub,
                                                                   TrainerServicer]]:
    servicer = TrainerServicer(TrainerEngine(load_tiny(MODEL, fresh=True)))
    server = serve_servicer("trainer", servicer, ServerConfig(host="127.0.0.1", port=0))
    channel = connect(server.address)
    try:
        yield api.trainer_pb2_grpc.TrainerServiceStub(channel), servicer
    finally:
        channel.close()
        server.stop(grace=0)


def train_request(completions: list[object], **loss: object) -> pb.TrainStepRequest:
    rewards = [float(sum(t % 3 == 0 for t in c.token_ids)) for c in completions]  # type: ignore[attr-defined]
    adv = group_advantages(rewards, 2)
    return pb.TrainStepRequest(
        samples=[pb.TrainSample(prompt_ids=c.prompt_ids, token_ids=c.token_ids,  # type: ignore[attr-defined]
                                old_logprobs=c.logprobs, advantage=a, temperature=c.temperature)  # type: ignore[attr-defined]
                 for c, a in zip(completions, adv, strict=True)],
        loss=pb.LossConfig(**{"clip_eps_low": 0.2, "clip_eps_high": 0.28, "loss_agg": "token-mean",
                              "kl_estimator": "k3", "epochs": 1, "minibatches": 2, **loss}),
        optimizer=pb.OptimizerConfig(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01, grad_clip=1.0))


def test_compute_logprobs_equals_in_process_forward(served: tuple, load_tiny: Callable[..., LoadedModel]) -> None:
    stub, _ = served
    seqs = [ScoredSequence((1, 2, 3), (4, 5, 6, 7), 1.0), ScoredSequence((9,) * 20, (8, 7), 0.7),
            ScoredSequence((300,), (2,), 1.3)]
    req = pb.ComputeLogprobsRequest(sequences=[api.common_pb2.ScoredSequence(
        prompt_ids=s.prompt_ids, token_ids=s.token_ids, temperature=s.temperature) for s in seqs], pack_tokens=7)
    resp = stub.ComputeLogprobs(req, timeout=60)
    with torch.no_grad():
        want = sequence_logprobs(load_tiny(MODEL).model, seqs)
    for got, w in zip(resp.results, want, strict=True):
        assert torch.equal(torch.tensor(list(got.logprobs), dtype=torch.float32), w)
    assert resp.weight_version == 0 and resp.weight_sha256 == load_tiny(MODEL).weights_sha256
    assert resp.kernel_fingerprint == load_tiny(MODEL).model.ops.fingerprint


def test_train_export_checkpoint_and_info(served: tuple, completions: list[object], tmp_path: Path) -> None:
    stub, servicer = served
    info0 = stub.GetInfo(pb.TrainerServiceGetInfoRequest(), timeout=30)
    assert info0.step == 0 and info0.info.service == "trainer" and info0.info.model == MODEL
    assert info0.info.kernel_config.kv_tile == 16

    first = stub.TrainStep(train_request(completions), timeout=120)
    assert first.step == 1 and first.tokens == sum(len(c.token_ids) for c in completions)  # type: ignore[attr-defined]
    assert first.old_logprob_max_abs_diff == 0.0  # rollout logprobs crossed the wire bit for bit
    assert math.isfinite(first.loss) and first.grad_norm > 0 and first.seconds > 0 and first.tokens_per_second > 0
    second = stub.TrainStep(train_request(completions), timeout=120)
    assert second.step == 2 and second.old_logprob_max_abs_diff > 0

    info = stub.GetInfo(pb.TrainerServiceGetInfoRequest(), timeout=30)
    assert info.step == 2 and info.info.weight_version == 2 and info.info.weight_sha256 != info0.info.weight_sha256

    ref = stub.ExportWeights(pb.ExportWeightsRequest(directory=str(tmp_path / "w")), timeout=60).weights
    assert ref.version == 2 and file_sha256(ref.path) == ref.sha256
    tensors = load_weights(WeightsRef(ref.path, ref.sha256, ref.version, ref.kernel_fingerprint),
                           info.info.kernel_fingerprint)
    assert all(torch.equal(tensors[k], v) for k, v in servicer.engine.state_dict_for_rollout().items())

    saved = stub.SaveCheckpoint(pb.SaveCheckpointRequest(directory=str(tmp_path / "ckpt"),
                                                         extra_json=json.dumps({"cursor": 8})), timeout=60)
    assert saved.step == 2 and Path(saved.path).name == "step-000002"
    state = load_checkpoint(tmp_path / "ckpt")
    assert state.step == 2 and json.loads(state.extra_json) == {"cursor": 8}
    with pytest.raises(grpc.RpcError) as err:  # checkpoints are immutable
        stub.SaveCheckpoint(pb.SaveCheckpointRequest(directory=str(tmp_path / "ckpt")), timeout=60)
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    with pytest.raises(grpc.RpcError) as err:  # no reference policy was kept from step 0
        stub.TrainStep(train_request(completions, kl_coef=0.1), timeout=60)
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION and "reference" in err.value.details()


def _bad_train(completions: list[object]) -> list[tuple[str, Callable[[pb.TrainStepRequest], None]]]:
    def nan_adv(r: pb.TrainStepRequest) -> None:
        r.samples[3].advantage = math.nan

    return [
        ("samples", lambda r: r.ClearField("samples")),
        ("samples[2].old_logprobs", lambda r: r.samples[2].old_logprobs.append(-1.0)),
        ("samples[0].token_ids", lambda r: r.samples[0].token_ids.__setitem__(1, 320)),
        ("samples[1].prompt_ids", lambda r: r.samples[1].ClearField("prompt_ids")),
        ("samples[3].advantage", nan_adv),
        ("samples[0].temperature", lambda r: setattr(r.samples[0], "temperature", -1.0)),
        ("loss", lambda r: r.ClearField("loss")),
        ("loss.clip_eps_low", lambda r: setattr(r.loss, "clip_eps_low", 1.0)),
        ("loss.clip_eps_high", lambda r: setattr(r.loss, "clip_eps_high", -0.1)),
        ("loss.loss_agg", lambda r: setattr(r.loss, "loss_agg", "sum")),
        ("loss.kl_estimator", lambda r: setattr(r.loss, "kl_estimator", "k2")),
        ("loss.kl_coef", lambda r: setattr(r.loss, "kl_coef", -1.0)),
        ("loss.minibatches", lambda r: setattr(r.loss, "minibatches", 5)),
        ("loss.epochs", lambda r: setattr(r.loss, "epochs", -1)),
        ("optimizer", lambda r: r.ClearField("optimizer")),
        ("optimizer.lr", lambda r: setattr(r.optimizer, "lr", 0.0)),
        ("optimizer.lr", lambda r: setattr(r.optimizer, "lr", math.inf)),
        ("optimizer.beta2", lambda r: setattr(r.optimizer, "beta2", 1.0)),
        ("optimizer.eps", lambda r: setattr(r.optimizer, "eps", 0.0)),
        ("optimizer.grad_clip", lambda r: setattr(r.optimizer, "grad_clip", -1.0)),
    ]


def _invalid(call: Callable[[], object]) -> list[str]:
    with pytest.raises(grpc.RpcError) as err:
        call()
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, err.value.details()
    return [f for f, _ in field_violations(err.value)]


def test_bad_requests_name_the_field(served: tuple, completions: list[object]) -> None:
    stub, servicer = served
    for field, mutate in _bad_train(completions):
        req = train_request(completions)
        mutate(req)
        assert _invalid(lambda req=req: stub.TrainStep(req, timeout=30)) == [field]
    seq = api.common_pb2.ScoredSequence(prompt_ids=[1, 2], token_ids=[3], temperature=1.0)
    for field, req in [
        ("sequences", pb.ComputeLogprobsRequest()),
        ("sequences[1].token_ids", pb.ComputeLogprobsRequest(sequences=[seq, api.common_pb2.ScoredSequence(
            prompt_ids=[1], token_ids=[-4])])),
        ("sequences[0].temperature", pb.ComputeLogprobsRequest(sequences=[api.common_pb2.ScoredSequence(
            prompt_ids=[1], token_ids=[2], temperature=math.nan)])),
        ("sequences[0]", pb.ComputeLogprobsRequest(sequences=[api.common_pb2.ScoredSequence(
            prompt_ids=[1] * 2048, token_ids=[2, 3])])),
        ("pack_tokens", pb.ComputeLogprobsRequest(sequences=[seq], pack_tokens=-1)),
    ]:
        assert _invalid(lambda req=req: stub.ComputeLogprobs(req, timeout=30)) == [field]
    assert _invalid(lambda: stub.ExportWeights(pb.ExportWeightsRequest(), timeout=30)) == ["directory"]
    assert _invalid(lambda: stub.SaveCheckpoint(pb.SaveCheckpointRequest(directory="/tmp/x", extra_json="{bad"),
                                                timeout=30)) == ["extra_json"]
    assert servicer.engine.step == 0 and servicer.engine.optimizer is None  # nothing was applied
    # unset proto3 scalars that mean "default": temperature 0 -> 1.0, epochs/minibatches 0 -> 1
    ok = train_request(completions, epochs=0, minibatches=0, kl_estimator="")
    assert stub.TrainStep(ok, timeout=60).step == 1


def test_build_trainer_service_runs_the_selftest(tmp_home: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from onpolicy.kernels import KernelConfig
    from onpolicy.kernels.selftest import ProbeResult, SelftestReport, certificate_path
    from onpolicy.services.common import model as common_model
    from onpolicy.services.common.model import UncertifiedBackend
    from onpolicy.services.trainer.service import build_trainer_service

    config = KernelConfig(kv_tile=16)
    assert not certificate_path(config).exists()
    servicer = build_trainer_service(MODEL, config)  # no certificate yet: the selftest runs and passes
    assert certificate_path(config).is_file() and servicer.engine.step == 0
    with pytest.raises(ValueError, match="consistent kernels"):
        build_trainer_service(MODEL, config.with_(backend="fast"))

    def failing(cfg: KernelConfig, shapes: object, progress: object = None) -> SelftestReport:
        return SelftestReport(cfg.backend, cfg.fingerprint, shapes, {},  # type: ignore[arg-type]
                              [ProbeResult("linear/qkv", False, 1, "batch 3")])

    monkeypatch.setattr(common_model, "run_selftest", failing)
    with pytest.raises(UncertifiedBackend, match="linear/qkv"):
        build_trainer_service(MODEL, config.with_(kv_tile=32))


def test_a_checkpoint_that_does_not_fit_on_disk_fails_cleanly(served: tuple, tmp_path: Path,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    import shutil
    from collections import namedtuple

    stub, servicer = served
    root = tmp_path / "ckpt"
    first = stub.SaveCheckpoint(pb.SaveCheckpointRequest(directory=str(root)), timeout=60)
    size = sum(f.stat().st_size for f in Path(first.path).iterdir())
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda _: usage(1 << 40, 1 << 40, size))  # less than a checkpoint
    servicer.engine.step += 1  # a new step to save
    with pytest.raises(grpc.RpcError) as err:
        stub.SaveCheckpoint(pb.SaveCheckpointRequest(directory=str(root)), timeout=60)
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "not enough free space" in err.value.details() and str(root) in err.value.details()
    assert sorted(p.name for p in root.iterdir()) == ["latest", Path(first.path).name]  # nothing torn, nothing new
    assert load_checkpoint(root).step == first.step
