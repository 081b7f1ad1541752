"""``parallel`` in the services: a trainer service built with ``data_parallel=2`` (rank 0 in this process,
its peer a Ray actor) answers TrainStep over gRPC with the statistics and weights of the ``dp=1`` service;
the job spec's ``dp`` reaches the trainer's role options; the JobService refuses the tensor and expert
degrees the services do not run, naming the field."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import grpc
import pytest

from onpolicy.jobs.spec import parse_spec
from onpolicy.kernels import KernelConfig
from onpolicy.kernels.selftest import num_threads
from onpolicy.services import api
from onpolicy.services.cluster.actors import RayLauncher
from onpolicy.services.common.client import connect, field_violations
from onpolicy.services.common.server import GrpcServer, ServerConfig
from onpolicy.services.controller.controller import JobController
from onpolicy.services.controller.convert import spec_to_proto
from onpolicy.services.controller.servicer import jobs_server
from onpolicy.services.roles import options_for, serve_servicer
from onpolicy.services.trainer.service import build_trainer_service
from onpolicy.trainer.config import TrainerConfig, TrainSample
from onpolicy.trainer.data_parallel import DataParallelEngine

pb = api.trainer_pb2


@contextmanager
def _served(server: GrpcServer) -> Iterator[grpc.Channel]:
    channel = connect(server.address)
    try:
        yield channel
    finally:
        channel.close()
        server.stop(grace=0)


def _request(samples: list[TrainSample], minibatches: int) -> pb.TrainStepRequest:
    return pb.TrainStepRequest(
        samples=[pb.TrainSample(prompt_ids=s.prompt_ids, token_ids=s.token_ids, old_logprobs=s.old_logprobs,
                                advantage=s.advantage, temperature=s.temperature) for s in samples],
        loss=pb.LossConfig(clip_eps_low=0.2, clip_eps_high=0.28, loss_agg="token-mean", kl_estimator="k3",
                           epochs=1, minibatches=minibatches),
        optimizer=pb.OptimizerConfig(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01, grad_clip=1.0))


def test_trainer_service_with_two_ranks_equals_one(ray_cluster: None, batches: list[list[TrainSample]]) -> None:
    seen = {}
    with num_threads(1):  # the peer gets this process's thread count
        for dp in (2, 1):
            servicer = build_trainer_service("tiny-qwen3", KernelConfig(kv_tile=16), TrainerConfig(pack_tokens=24),
                                             data_parallel=dp)
            assert isinstance(servicer.engine, DataParallelEngine) == (dp > 1)
            try:
                with _served(serve_servicer("trainer", servicer, ServerConfig(host="127.0.0.1", port=0))) as ch:
                    stub = api.trainer_pb2_grpc.TrainerServiceStub(ch)
                    steps = [stub.TrainStep(_request(b, mb), timeout=120)
                             for b, mb in zip(batches, (1, 2), strict=True)]
                    for st in steps:
                        st.seconds = st.tokens_per_second = st.recompute_seconds = 0.0
                    info = stub.GetInfo(pb.TrainerServiceGetInfoRequest(), timeout=60).info
                    seen[dp] = (steps, info.weight_version, info.weight_sha256)
            finally:
                if isinstance(servicer.engine, DataParallelEngine):
                    servicer.engine.close()
    assert seen[2] == seen[1] and seen[2][1] == 2


def test_spec_degrees_reach_the_trainer_role() -> None:
    spec = parse_spec({"model": "tiny-qwen3", "parallel": {"trainer": {"dp": 2}},
                       "resources": {"trainer": {"npus": 2}}})
    opts = options_for(spec, "trainer")
    assert (opts.dp, opts.peer_npus) == (2, 2)
    opts = options_for(parse_spec({"model": "tiny-qwen3-moe", "parallel": {"trainer": {"tp": 2, "ep": 4}}}),
                       "trainer")
    assert (opts.tp, opts.ep, opts.dp) == (2, 4, 1)


@pytest.mark.parametrize(("parallel", "field", "text"), [
    ({"trainer": {"ep": 2}}, "spec.parallel.trainer.ep", "needs a mixture-of-experts model"),
    ({"trainer": {"tp": 2, "dp": 2}}, "spec.parallel.trainer.dp", "not both at once"),
])
def test_job_service_refuses_degrees_it_does_not_run(tmp_path: Path, parallel: dict, field: str, text: str) -> None:
    controller = JobController(tmp_path, RayLauncher())
    try:
        with _served(jobs_server(controller, ServerConfig(host="127.0.0.1", port=0))) as ch:
            spec = parse_spec({"model": "tiny-qwen3", "parallel": parallel})
            with pytest.raises(grpc.RpcError) as e:
                api.jobs_pb2_grpc.JobServiceStub(ch).SubmitJob(
                    api.jobs_pb2.SubmitJobRequest(spec=spec_to_proto(spec)), timeout=30)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        (got, desc), = field_violations(e.value)
        assert got == field and text in desc
        assert controller.list() == []
    finally:
        controller.shutdown()
