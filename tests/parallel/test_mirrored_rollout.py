"""``MirroredRolloutEngine``: rank 0 in this process, its peer ranks Ray actors, every state change
mirrored. Generations, after a weight update too, equal one unsharded engine's bit for bit (tp=2 on
tiny-qwen3, ep=2 on tiny-qwen3-moe); a killed peer is named by ``PeerFailed`` and every peer ends."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from onpolicy.models.loading import LoadedModel, weights_sha256
from onpolicy.parallel.mirrored import MirroredRolloutEngine
from onpolicy.parallel.peers import PeerFailed
from onpolicy.rollout import EngineConfig, RolloutEngine, SamplingParams
from onpolicy.services.cluster.peers import ray_peers

PROMPTS = [[1, 2, 3, 4, 5], [40, 41, 42], [100, 7, 9, 11, 13, 15]]
PARAMS = SamplingParams(temperature=1.0, max_new_tokens=6, n=2, seed=5, ignore_eos=True)
CONFIG = EngineConfig(kv_cache_tokens=512)


def _same(a: list, b: list) -> None:
    assert [c.token_ids for c in a] == [c.token_ids for c in b]
    for x, y in zip(a, b, strict=True):
        assert torch.equal(torch.tensor(x.logprobs, dtype=torch.float32), torch.tensor(y.logprobs, dtype=torch.float32))


@pytest.mark.parametrize(("model", "tp", "ep"), [("tiny-qwen3", 2, 1), ("tiny-qwen3-moe", 1, 2)])
def test_mirrored_rollout_equals_one_engine(ray_cluster: None, load_tiny: Callable[..., LoadedModel],
                                            model: str, tp: int, ep: int) -> None:
    lm = load_tiny(model, fresh=True)
    state = {k: v + 0.01 * torch.randn(v.shape, generator=torch.Generator().manual_seed(1), dtype=v.dtype)
             for k, v in lm.model.state_dict().items()}
    single = RolloutEngine(lm, CONFIG)
    with MirroredRolloutEngine(lm, CONFIG, tp=tp, ep=ep, launch=ray_peers, model_ref=model,
                               peer_options={"num_cpus": 1}) as par:
        assert len(par.peers.actors) == 1
        _same(par.generate(PROMPTS, PARAMS), single.generate(PROMPTS, PARAMS))
        single.update_weights(state, 1)
        par.update_weights(state, 1)
        # the full weights' checksum, as the unsharded engine's, not rank 0's shard's
        assert par.lm.weights_sha256 == single.lm.weights_sha256 == weights_sha256(state)
        assert weights_sha256(par.lm.model.state_dict()) != par.lm.weights_sha256
        _same(par.generate(PROMPTS, PARAMS), single.generate(PROMPTS, PARAMS))


def test_dead_peer_is_named_and_peers_end(ray_cluster: None, load_tiny: Callable[..., LoadedModel]) -> None:
    import ray

    lm = load_tiny("tiny-qwen3", fresh=True)
    par = MirroredRolloutEngine(lm, CONFIG, tp=2, launch=ray_peers, model_ref="tiny-qwen3",
                                peer_options={"num_cpus": 1}, timeout_s=30.0)
    peer = par.peers.actors[0]
    ray.kill(peer)
    par.add_request(PROMPTS[0], PARAMS)
    with pytest.raises(PeerFailed, match="rollout rank 1 of 2 failed"):
        par.step()
    assert par.peers.actors == [] and par.failed.startswith("rollout rank 1 of 2 failed")


def test_job_spec_degrees_reach_the_rollout_engine(ray_cluster: None, tiny_paths: object) -> None:
    from onpolicy.jobs.spec import parse_spec
    from onpolicy.services.roles import ROLES, options_for

    opts = options_for(parse_spec({"model": "tiny-qwen3", "parallel": {"rollout": {"tp": 2}}}), "rollout")
    servicer = ROLES["rollout"].build(opts)
    engine = servicer.engine
    assert isinstance(engine, MirroredRolloutEngine) and engine.world == 2 and len(engine.peers.actors) == 1
    servicer.close()  # what stopping the service does: the peer rank ends with it
    assert engine.peers.actors == []
