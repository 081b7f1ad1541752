"""Fixtures of the data-parallel tests: an embedded Ray on loopback per test module, and real rollouts of
tiny-qwen3 to train on."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest

from onpolicy.models.checkpoint import LoadedModel
from onpolicy.rollout import EngineConfig, RolloutEngine, SamplingParams
from onpolicy.trainer.config import TrainSample
from onpolicy.trainer.grpo import group_advantages


@pytest.fixture(scope="module")
def ray_cluster() -> Iterator[None]:
    from onpolicy.services.cluster.local_ray import init_ray, shutdown_ray

    init_ray(num_cpus=4)
    yield
    shutdown_ray()


@pytest.fixture(scope="module")
def batches(load_tiny: Callable[..., LoadedModel]) -> list[list[TrainSample]]:
    """Two global batches of real rollouts (8 samples each), rewarded by the share of even token ids."""
    lm = load_tiny("tiny-qwen3")
    out = []
    for seed in (3, 4):
        comps = RolloutEngine(lm, EngineConfig(kv_cache_tokens=1024)).generate(
            [[1, 2, 3, 4, 5], [40, 41, 42], [100, 7, 9, 11, 13, 15], [8, 6]],
            SamplingParams(temperature=1.0, max_new_tokens=8, n=2, seed=seed, ignore_eos=True))
        rewards = [sum(t % 2 == 0 for t in c.token_ids) / len(c.token_ids) for c in comps]
        out.append([TrainSample(prompt_ids=c.prompt_ids, token_ids=c.token_ids, old_logprobs=c.logprobs,
                                advantage=a, temperature=c.temperature)
                    for c, a in zip(comps, group_advantages(rewards, 2), strict=True)])
    return out
