"""Rollout service under load (real gRPC on loopback, tiny-qwen3): admission control admits calls
within the in-flight token bound, queues up to the queue bound, answers RESOURCE_EXHAUSTED beyond
it; a cancelled Generate call aborts its sequences in the engine (their KV pages freed) instead of
running them to the end. States are asserted, not timings: the engine thread is held while the
gate fills, so nothing can finish in between."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator

import grpc
import pytest

from onpolicy.models.loading import LoadedModel
from onpolicy.rollout import EngineConfig, RolloutEngine
from onpolicy.services import api
from onpolicy.services.common.client import connect
from onpolicy.services.common.role_metrics import RolloutMetrics
from onpolicy.services.common.server import ServerConfig
from onpolicy.services.roles import serve_servicer
from onpolicy.services.rollout.servicer import RolloutServicer

PROMPT = [5, 6, 7, 8]
MAX_NEW = 64
COST = len(PROMPT) + MAX_NEW


def request(max_new: int = MAX_NEW, n: int = 1) -> api.rollout_pb2.GenerateRequest:
    return api.rollout_pb2.GenerateRequest(
        prompts=[api.rollout_pb2.Prompt(prompt_ids=PROMPT)],
        params=api.rollout_pb2.SamplingParams(temperature=1.0, max_new_tokens=max_new, n=n, seed=1, ignore_eos=True))


@pytest.fixture
def rollout(load_tiny: Callable[..., LoadedModel]) -> Iterator[tuple[object, RolloutServicer]]:
    engine = RolloutEngine(load_tiny("tiny-qwen3"), EngineConfig(max_num_seqs=8, kv_cache_tokens=4096))
    servicer = RolloutServicer(engine, max_inflight_tokens=COST, max_queued_requests=1)
    server = serve_servicer("rollout", servicer)
    channel = connect(server.address)
    try:
        yield api.rollout_pb2_grpc.RolloutServiceStub(channel), servicer
    finally:
        channel.close()
        server.stop(grace=0)


def until(cond: Callable[[], bool], what: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)


def metrics(servicer: RolloutServicer) -> dict[str, float]:
    """The admission metrics the rollout's Prometheus collector exports right now."""
    names = ("admitted_token_positions", "queued_requests", "rejected_requests_total", "aborted_sequences_total")
    return {s.name: s.value for fam in RolloutMetrics(servicer).collect() for s in fam.samples
            if s.name.removeprefix("onpolicy_rollout_") in names}


@contextlib.contextmanager
def one_admitted_one_queued(stub, servicer: RolloutServicer) -> Iterator[tuple[object, object]]:
    """Hold the engine thread (nothing admitted can finish), send a call that is admitted and one
    that queues behind it; yields both calls, and lets the engine go on exit."""
    gate, hold = servicer.admission, threading.Event()
    holder = threading.Thread(target=servicer.worker.call_idle, args=(lambda _: hold.wait(60),))
    holder.start()
    try:
        first = stub.Generate(request())
        until(lambda: gate.inflight_tokens == COST, "the first call to be admitted")
        second = stub.Generate(request())
        until(lambda: gate.queued == 1, "the second call to queue")
        yield first, second
    finally:
        hold.set()
        holder.join()


def test_admits_within_the_bound_queues_then_refuses(rollout) -> None:
    stub, servicer = rollout
    gate = servicer.admission
    with one_admitted_one_queued(stub, servicer) as (first, second):
        with pytest.raises(grpc.RpcError) as e:
            list(stub.Generate(request(), timeout=30))  # queue full
        assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "busy" in e.value.details()
        with pytest.raises(grpc.RpcError) as e:
            list(stub.Generate(request(max_new=MAX_NEW + 1), timeout=30))  # could never fit
        assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert (gate.stats.admitted, gate.stats.rejected) == (1, 2)
        assert metrics(servicer) == {"onpolicy_rollout_admitted_token_positions": COST,
                                     "onpolicy_rollout_queued_requests": 1,
                                     "onpolicy_rollout_rejected_requests_total": 2,
                                     "onpolicy_rollout_aborted_sequences_total": 0}
    assert len(list(first)) == 1 and len(list(second)) == 1  # the queued call ran once the first finished
    assert gate.inflight_tokens == 0 and gate.queued == 0 and gate.stats.admitted == 2


def test_a_cancelled_call_leaves_the_queue(rollout) -> None:
    stub, servicer = rollout
    gate = servicer.admission
    with one_admitted_one_queued(stub, servicer) as (first, queued):
        queued.cancel()
        until(lambda: gate.queued == 0, "the cancelled call to leave the queue")
        assert gate.stats.abandoned == 1
    assert len(list(first)) == 1 and gate.stats.admitted == 1


def test_the_server_bounds_the_rpcs_it_holds(load_tiny: Callable[..., LoadedModel]) -> None:
    engine = RolloutEngine(load_tiny("tiny-qwen3"), EngineConfig(max_num_seqs=8, kv_cache_tokens=4096))
    servicer = RolloutServicer(engine, max_inflight_tokens=COST, max_queued_requests=8)
    server = serve_servicer("rollout", servicer, ServerConfig(port=0, max_concurrent_rpcs=2))
    stub = api.rollout_pb2_grpc.RolloutServiceStub(connect(server.address))
    try:
        with one_admitted_one_queued(stub, servicer) as (first, second):
            with pytest.raises(grpc.RpcError) as e:  # a third RPC is refused before it takes a handler thread
                list(stub.Generate(request(), timeout=30))
            assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and servicer.admission.stats.rejected == 0
        assert len(list(first)) == 1 and len(list(second)) == 1
    finally:
        server.stop(grace=0)


def test_a_cancelled_generate_aborts_its_sequences_in_the_engine(rollout) -> None:
    stub, servicer = rollout
    servicer.admission.max_inflight_tokens = 10_000
    engine, n, max_new = servicer.engine, 4, 1500
    call = stub.Generate(request(max_new=max_new, n=n))
    until(lambda: len(engine.scheduler.running) == n, "the sequences to run")
    call.cancel()
    until(lambda: servicer.worker.aborted_sequences == n, "the sequences to be aborted")
    until(lambda: not engine.has_unfinished(), "the engine to be idle")
    assert engine.stats().tokens_generated < n * max_new  # they did not run to the end
    assert engine.blocks.num_free == engine.blocks.num_pages  # every KV page is free again
    assert metrics(servicer)["onpolicy_rollout_aborted_sequences_total"] == n
    assert len(list(stub.Generate(request(max_new=4), timeout=60))) == 1  # and the service keeps serving


def test_bench_load_reports_rejections_within_the_bounds(capsys) -> None:
    import json

    from onpolicy.cli.main import main

    assert main(["bench", "load", "--clients", "8", "--requests", "1", "--new-tokens", "4", "--prompt-len", "4",
                 "--max-inflight-tokens", "8", "--max-queued", "1", "--json"]) == 0
    r = json.loads(capsys.readouterr().out)
    assert r["ok"] + r["rejected"] == 8 and r["ok"] >= 1 and r["other_errors"] == 0
    assert r["peak_inflight_tokens"] <= 8 and r["peak_queued"] <= 1 and r["p99_ms"] >= r["p50_ms"] > 0
