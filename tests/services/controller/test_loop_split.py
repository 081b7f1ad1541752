"""A batch that costs more token positions than one Generate call may is sent by the GRPO loop as
several calls of consecutive prompts, with the same completions, bit for bit, as one call: real
rollout servers over gRPC (127.0.0.1), one with a small admission budget, one without."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

from onpolicy.jobs.dataset import Problem
from onpolicy.jobs.prompts import Prompt
from onpolicy.jobs.spec import load_spec_file
from onpolicy.rollout import EngineConfig, RolloutEngine
from onpolicy.services import api
from onpolicy.services.common.client import connect
from onpolicy.services.common.server import ServerConfig
from onpolicy.services.controller.controller import job_inputs
from onpolicy.services.controller.loop import GRPOLoop, RoleStubs, split_by_cost
from onpolicy.services.roles import serve_servicer
from onpolicy.services.rollout import RolloutServicer

ROOT = Path(__file__).resolve().parents[3]


def test_split_by_cost() -> None:
    assert split_by_cost([3, 3, 3, 3], 0) == [(0, 4)]  # no limit
    assert split_by_cost([3, 3, 3, 3], 6) == [(0, 2), (2, 4)]
    assert split_by_cost([3, 3, 3, 3], 7) == [(0, 2), (2, 4)]
    assert split_by_cost([3, 9, 3], 6) == [(0, 1), (1, 2), (2, 3)]  # too big alone: its own call
    assert split_by_cost([], 5) == []


@pytest.fixture
def rollout(load_tiny: Callable[..., object]) -> Iterator[Callable[[int | None], tuple[RoleStubs, RolloutServicer]]]:
    started = []

    def start(budget: int | None) -> tuple[RoleStubs, RolloutServicer]:
        servicer = RolloutServicer(RolloutEngine(load_tiny("tiny-qwen3"), EngineConfig(kv_cache_tokens=1024)),
                                   max_inflight_tokens=budget)
        server = serve_servicer("rollout", servicer, ServerConfig(port=0))
        channel = connect(server.address)
        started.append((server, channel))
        stub = api.rollout_pb2_grpc.RolloutServiceStub(channel)
        return RoleStubs(rollout=stub, trainer=None, verifier=None), servicer

    yield start
    for server, channel in started:
        channel.close()
        server.stop(grace=0)


def test_an_oversize_batch_goes_as_several_calls_with_the_same_completions(rollout, tmp_path: Path) -> None:
    spec = load_spec_file(ROOT / "examples/jobs/tiny.yaml")
    batch = [Prompt(Problem(f"p{i}", "0"), tuple(range(3 + i, 10 + 2 * i))) for i in range(6)]
    per_prompt = [2 * (len(p.ids) + spec.rollout.max_new_tokens) for p in batch]

    def generate(budget: int | None) -> tuple[list, int]:
        stubs, servicer = rollout(budget)
        loop = GRPOLoop("job-s", spec, stubs, job_inputs(spec)[0], tmp_path, lambda e: None, lambda: False)
        comps = loop._generate(batch, seed=3, temperature=1.0, n=2)
        return comps, servicer.admission.stats.admitted

    whole, calls = generate(None)
    assert calls == 1
    split, calls = generate(max(per_prompt) + 1)  # every call holds one prompt, at most two
    assert calls >= 3
    assert [(c.prompt_index, c.sample_index) for c in split] == [(i, s) for i in range(6) for s in range(2)]
    for a, b in zip(whole, split, strict=True):
        assert list(a.prompt_ids) == list(b.prompt_ids) and list(a.token_ids) == list(b.token_ids)
        assert torch.equal(torch.tensor(list(a.logprobs)), torch.tensor(list(b.logprobs)))
