"""``rollout.top_p`` / ``top_k`` / ``min_p`` in the job spec: validated, kept through the gRPC
``RolloutSpec`` (proto3 presence), sent with every ``Generate`` request, and each completion's
truncation forwarded with its ``TrainSample`` so the trainer scores the distribution sampled."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from onpolicy.jobs.spec import SpecError, load_spec_file, parse_spec
from onpolicy.services import api
from onpolicy.services.controller.convert import spec_from_proto, spec_to_proto
from onpolicy.services.controller.loop import GRPOLoop, JobInputs

ROOT = Path(__file__).resolve().parents[2]
BASE = load_spec_file(ROOT / "examples/jobs/tiny.yaml")


def _spec(**rollout: Any):
    data = BASE.model_dump(mode="json")
    data["rollout"] = {**data["rollout"], **rollout}
    return parse_spec(data)


def test_defaults_are_off_and_values_round_trip_the_proto() -> None:
    off = _spec()
    assert (off.rollout.top_p, off.rollout.top_k, off.rollout.min_p) == (1.0, 0, 0.0)
    spec = _spec(top_p=0.9, top_k=50, min_p=0.05)
    back = spec_from_proto(spec_to_proto(spec))
    assert (back.rollout.top_p, back.rollout.top_k, back.rollout.min_p) == (0.9, 50, 0.05)
    msg = spec_to_proto(spec)
    assert msg.rollout.HasField("top_p") and msg.rollout.HasField("top_k") and msg.rollout.HasField("min_p")


@pytest.mark.parametrize("field, bad", [("top_p", 0.0), ("top_p", 1.5), ("top_k", -1), ("min_p", 1.2)])
def test_bad_values_are_named(field: str, bad: float) -> None:
    with pytest.raises(SpecError) as e:
        _spec(**{field: bad})
    assert f"rollout.{field}" in [f for f, _ in e.value.violations]


class _Rollout:
    def __init__(self) -> None:
        self.requests: list[Any] = []

    def GetInfo(self, req: Any, timeout: float) -> Any:
        return SimpleNamespace(info=api.common_pb2.ServiceInfo(max_request_token_positions=1 << 20))

    def Generate(self, req: Any, timeout: float) -> list[Any]:
        self.requests.append(req)
        c = api.common_pb2.Completion(prompt_index=0, sample_index=0, prompt_ids=[1], token_ids=[2, 3],
                                      logprobs=[-0.5, -0.25], temperature=req.params.temperature or 1.0,
                                      top_k=req.params.top_k, top_p=req.params.top_p, min_p=req.params.min_p)
        return [SimpleNamespace(completion=c)]


class _Trainer:
    def __init__(self) -> None:
        self.requests: list[Any] = []

    def TrainStep(self, req: Any, timeout: float) -> Any:
        self.requests.append(req)
        return SimpleNamespace()


def test_generate_and_train_requests_carry_the_truncation() -> None:
    spec = _spec(top_p=0.9, top_k=50, min_p=0.05)
    stubs = SimpleNamespace(rollout=_Rollout(), trainer=_Trainer())
    loop = GRPOLoop("j", spec, stubs, JobInputs(prompts=[], rewards=None), Path("/tmp"),  # type: ignore[arg-type]
                    lambda ev: None, lambda: False)
    comps = loop._generate([SimpleNamespace(ids=[1])], seed=3, temperature=0.8, n=1)  # type: ignore[list-item]
    params = stubs.rollout.requests[0].params
    assert (params.top_k, round(params.top_p, 6), round(params.min_p, 6)) == (50, 0.9, 0.05)
    loop._train(comps, [1.0])
    (sample,) = stubs.trainer.requests[0].samples
    assert (sample.top_k, sample.top_p, sample.min_p) == (params.top_k, params.top_p, params.min_p)
