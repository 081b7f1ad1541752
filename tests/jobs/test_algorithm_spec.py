"""The job spec's ``algorithm`` and ``correction``: each algorithm's ``grpo`` defaults (written values
win), the round trip through the ``JobSpec`` message, the validation rules; and the loop's DAPO
dynamic sampling (drop all-equal-reward groups, refill from the data cursor, top up after the last
round) on scripted rollouts."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from onpolicy.jobs.spec import JobSpec, SpecError, load_spec_file, parse_spec
from onpolicy.services.controller.convert import spec_from_proto, spec_to_proto
from onpolicy.services.controller.loop import ROUND_SEED_STRIDE, GRPOLoop, JobInputs

ROOT = Path(__file__).resolve().parents[2]
BASE = load_spec_file(ROOT / "examples/jobs/tiny.yaml").model_dump(mode="json")


def _spec(**over: Any) -> JobSpec:
    data = {k: v for k, v in BASE.items() if k not in ("grpo", "algorithm", "correction")}
    data["grpo"] = {"group_size": 4, "prompts_per_step": 2}
    for k, v in over.items():
        data[k] = {**data.get(k, {}), **v} if isinstance(v, dict) else v
    return parse_spec(data)


def test_algorithm_defaults_and_written_values_win() -> None:
    assert _spec().algorithm == "grpo" and _spec().grpo.scale_rewards and _spec().grpo.loss_agg == "token-mean"
    gspo = _spec(algorithm="gspo").grpo
    assert (gspo.loss_agg, gspo.clip_eps_low, gspo.clip_eps_high) == ("seq-mean", 3e-4, 4e-4)
    dapo = _spec(algorithm="dapo", rollout={"max_new_tokens": 20}).grpo
    assert dapo.dynamic_sampling and dapo.overlong_buffer == 4 and dapo.clip_eps_high == 0.28
    dr = _spec(algorithm="dr-grpo").grpo
    assert not dr.scale_rewards and dr.loss_agg == "seq-mean-token-sum-norm"
    written = _spec(algorithm="dr-grpo", grpo={"scale_rewards": True, "loss_agg": "token-mean"}).grpo
    assert written.scale_rewards and written.loss_agg == "token-mean"
    assert not _spec(algorithm="dapo", grpo={"dynamic_sampling": False}).grpo.dynamic_sampling


@pytest.mark.parametrize("algorithm", ["grpo", "gspo", "dapo", "dr-grpo"])
def test_round_trip_through_the_message(algorithm: str) -> None:
    spec = _spec(algorithm=algorithm, correction={"mode": "tis", "level": "sequence", "threshold": 3.0},
                 grpo={"entropy_coef": 0.01, "lr_schedule": "cosine", "warmup_steps": 2})
    assert spec_from_proto(spec_to_proto(spec)) == spec
    assert parse_spec(spec.model_dump(mode="json")) == spec


def test_correction_needs_recompute_and_turns_it_on() -> None:
    assert _spec(correction={"mode": "mis"}).grpo.recompute_old_logprobs
    assert not _spec().grpo.recompute_old_logprobs
    with pytest.raises(SpecError) as e:
        _spec(correction={"mode": "tis"}, grpo={"recompute_old_logprobs": False})
    assert [f for f, _ in e.value.violations] == ["correction.mode"]
    with pytest.raises(SpecError) as e:
        _spec(correction={"mode": "tis", "threshold": 0.5})
    assert [f for f, _ in e.value.violations] == ["correction.threshold"]


def test_invalid_algorithm_fields_are_named() -> None:
    for over, field in (({"algorithm": "ppo"}, "algorithm"),
                        ({"grpo": {"overlong_buffer": 17}}, "grpo.overlong_buffer"),
                        ({"grpo": {"lr_schedule": "linear"}}, "grpo.lr_schedule"),
                        ({"grpo": {"entropy_coef": -1}}, "grpo.entropy_coef")):
        with pytest.raises(SpecError) as e:
            _spec(**over)
        assert field in [f for f, _ in e.value.violations], (over, e.value.violations)


# --------------------------------------------------------------------------- dynamic sampling
def _loop(spec: JobSpec, rounds: list[list[float]]) -> tuple[GRPOLoop, list[tuple[int, int]]]:
    """A loop whose rollout returns one completion per sample and whose rewards follow ``rounds``."""
    prompts = [SimpleNamespace(ids=[i + 1], problem=None) for i in range(16)]
    loop = GRPOLoop("j", spec, SimpleNamespace(), JobInputs(prompts=prompts, rewards=None), Path("/tmp"),  # type: ignore[arg-type]
                    lambda ev: None, lambda: False)
    calls: list[tuple[int, int]] = []

    def generate(batch: list[Any], seed: int, temperature: float, n: int) -> list[Any]:
        calls.append((batch[0].ids[0], seed))
        return [SimpleNamespace(prompt=p.ids[0], token_ids=[1, 2]) for p in batch for _ in range(n)]

    def rewards(batch: list[Any], comps: list[Any]) -> tuple[list[float], float]:
        return rounds[len(calls) - 1], 0.0

    loop._generate = generate  # type: ignore[method-assign]
    loop._rewards = rewards  # type: ignore[method-assign]
    return loop, calls


def test_dynamic_sampling_drops_equal_groups_and_refills() -> None:
    spec = _spec(algorithm="dapo", grpo={"group_size": 2, "prompts_per_step": 2})
    loop, calls = _loop(spec, [[1, 1, 0, 1], [0, 0, 1, 0.5]])
    drawn = loop._draw(step=3)
    assert [c.prompt for c in drawn.comps] == [2, 2, 4, 4]  # prompt 1 and 3's groups were all-equal
    assert drawn.rewards == [0, 1, 1, 0.5] and drawn.dropped == 2 and drawn.generated_tokens == 16
    assert loop.cursor == 4
    assert [s for _, s in calls] == [spec.seed * 1_000_003 + 3, spec.seed * 1_000_003 + 3 + ROUND_SEED_STRIDE]


def test_dynamic_sampling_tops_up_after_the_last_round() -> None:
    spec = _spec(algorithm="dapo", grpo={"group_size": 2, "prompts_per_step": 2, "max_sampling_rounds": 2})
    loop, calls = _loop(spec, [[1, 1, 0, 0], [1, 0, 1, 1]])
    drawn = loop._draw(step=0)
    assert [c.prompt for c in drawn.comps] == [3, 3, 1, 1]  # the one kept group, then the first dropped
    assert drawn.dropped == 2 and len(calls) == 2 and loop.cursor == 4


def test_without_dynamic_sampling_the_batch_is_the_steps() -> None:
    loop, calls = _loop(_spec(grpo={"group_size": 2, "prompts_per_step": 2}), [[1, 1, 1, 1]])
    drawn = loop._draw(step=1)
    assert calls == [(3, _spec().seed * 1_000_003 + 1)] and drawn.dropped == 0 and len(drawn.comps) == 4
    assert loop.cursor == 0
