"""Top-k / top-p / min-p through vLLM with our sampler: the same tokens and logprob bits as our own
engine and the trainer (``torch.equal``), alone and in a batch mixing requests with other
truncations. Marked ``vllm``; skipped where vllm is not installed (``scripts/setup.sh --vllm``)."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from onpolicy.kernels import KernelConfig, get_backend
from onpolicy.kernels.truncation import NONE, Truncation
from onpolicy.models.registry import load_model
from onpolicy.rollout import Completion, EngineConfig, RolloutEngine, SamplingParams
from onpolicy.trainer.forward import ScoredSequence, sequence_logprobs

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None,
                       reason="vllm is not installed (bash scripts/setup.sh --vllm)"),
]

CONFIG = EngineConfig(max_num_seqs=16, max_batched_tokens=48, kv_cache_tokens=8192, prefix_cache=True)
TRUNCS = [Truncation(top_p=0.8), Truncation(top_k=5), Truncation(min_p=0.5), Truncation(top_k=40, top_p=0.9),
          NONE]
PROMPTS = [[(11 * i + 3 * j) % 250 + 2 for j in range(3 + 17 * i)] for i in range(4)]


@pytest.fixture(scope="module")
def engines():
    from onpolicy.rollout.vllm.engine import VllmEngine

    config = KernelConfig(backend="reference", compute_dtype="fp32")
    vllm = VllmEngine("tiny-qwen3-hd32", config, CONFIG)
    own = RolloutEngine(load_model("tiny-qwen3-hd32", get_backend(config)), CONFIG)
    yield vllm, own
    vllm.close()


def _params(t: Truncation, seed: int = 4) -> SamplingParams:
    return SamplingParams(temperature=0.6, max_new_tokens=12, n=2, seed=seed, ignore_eos=True, **t.to_dict())


def _lp(c: Completion) -> torch.Tensor:
    return torch.tensor(c.logprobs, dtype=torch.float32)


@pytest.mark.parametrize("trunc", TRUNCS, ids=lambda t: f"k{t.top_k}-p{t.top_p:.2f}-m{t.min_p:.2f}")
def test_vllm_with_truncation_equals_our_engine_and_the_trainer(engines, trunc: Truncation) -> None:
    vllm, own = engines
    got, want = vllm.generate(PROMPTS, _params(trunc)), own.generate(PROMPTS, _params(trunc))
    seqs = [ScoredSequence(c.prompt_ids, c.token_ids, c.temperature, **c.truncation.to_dict()) for c in got]
    with torch.no_grad():
        trainer = sequence_logprobs(vllm.lm.model, seqs, pack_tokens=256)
    for a, b, t in zip(got, want, trainer, strict=True):
        assert a.truncation == trunc and a.token_ids == b.token_ids
        assert torch.equal(_lp(a), _lp(b)) and torch.equal(_lp(a), t)


def test_requests_with_different_truncations_share_a_batch(engines) -> None:
    vllm, _ = engines
    alone = {i: vllm.generate([PROMPTS[i % 4]], _params(t, seed=i)) for i, t in enumerate(TRUNCS)}
    # all at once: queued together, so vLLM batches rows of different truncations in one sampler call
    ids = {i: vllm.add_request(PROMPTS[i % 4], _params(t, seed=i), prompt_index=i) for i, t in enumerate(TRUNCS)}
    done: list[Completion] = []
    while vllm.has_unfinished():
        done.extend(vllm.step())
    assert len(done) == sum(len(v) for v in ids.values())
    for c in done:
        ref = alone[c.prompt_index][c.sample_index]
        assert c.token_ids == ref.token_ids and torch.equal(_lp(c), _lp(ref))
