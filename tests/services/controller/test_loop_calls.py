"""How the GRPO loop sends its calls, to real rollout servers over gRPC (127.0.0.1).

A batch that costs more token positions than one Generate call may is sent as several calls of
consecutive prompts, with the same completions, bit for bit, as one call (one server with a small
admission budget, one without). Every call has the deadline the job's ``deadlines`` give it: one it
runs past fails with the call, the deadline and what it was made of named."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

from onpolicy.jobs.dataset import Problem
from onpolicy.jobs.prompts import Prompt
from onpolicy.jobs.spec import SpecError, load_spec_file, parse_spec
from onpolicy.rollout import EngineConfig, RolloutEngine
from onpolicy.services import api
from onpolicy.services.common.client import connect
from onpolicy.services.common.server import ServerConfig
from onpolicy.services.controller.controller import job_inputs
from onpolicy.services.controller.convert import spec_from_proto, spec_to_proto
from onpolicy.services.controller.loop import CallDeadlineExceeded, GRPOLoop, RoleStubs, split_by_cost
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


def _with_deadlines(**deadlines: float):
    raw = load_spec_file(ROOT / "examples/jobs/tiny.yaml").model_dump(mode="json")
    return parse_spec({**raw, "deadlines": deadlines})


def test_deadlines_are_validated_and_kept_through_the_proto() -> None:
    spec = _with_deadlines(call_s=12.5, per_position_s=0.25, weights_s=90)
    back = spec_from_proto(spec_to_proto(spec)).deadlines
    assert (back.call_s, back.per_position_s, back.weights_s) == (12.5, 0.25, 90)
    for field in ("call_s", "weights_s"):
        with pytest.raises(SpecError) as e:
            _with_deadlines(**{field: 0})
        assert f"deadlines.{field}" in [f for f, _ in e.value.violations]


def test_a_call_past_its_deadline_fails_naming_it(rollout, tmp_path: Path) -> None:
    spec = _with_deadlines(call_s=0.001, per_position_s=0.0)
    stubs, _ = rollout(None)
    loop = GRPOLoop("job-d", spec, stubs, job_inputs(spec)[0], tmp_path, lambda e: None, lambda: False)
    batch = [Prompt(Problem("p", "0"), tuple(range(3, 12)))]
    with pytest.raises(CallDeadlineExceeded, match=r"^Generate ran past its deadline of 0 s "
                                                   r"\(deadlines\.call_s 0\.001 \+ deadlines\.per_position_s 0 x "):
        loop._generate(batch, seed=3, temperature=1.0, n=2)
    # the negative control: the default deadlines let the same call finish
    ok = GRPOLoop("job-d", load_spec_file(ROOT / "examples/jobs/tiny.yaml"), stubs, job_inputs(spec)[0], tmp_path,
                  lambda e: None, lambda: False)
    assert len(ok._generate(batch, seed=3, temperature=1.0, n=2)) == 2
