"""Fixtures for the verifier tests: real completions from our rollout engine on tiny-qwen3, verifier
servicers on a private copy of the model, and a parsed view of a metrics registry."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest
from verifier_support import KV_TILE, MODEL


@pytest.fixture(scope="session")
def completions(load_tiny) -> list:
    """8 completions (4 prompts × 2 samples, 12 tokens each at most) sampled by our rollout engine."""
    from onpolicy.rollout import RolloutEngine, SamplingParams

    engine = RolloutEngine(load_tiny(MODEL, kv_tile=KV_TILE))
    prompts = [[1, 2, 3, 4], [5, 6, 7], [9, 10, 11, 12, 13], [20, 21]]
    comps = engine.generate(prompts, SamplingParams(temperature=1.0, max_new_tokens=12, n=2, seed=7,
                                                    ignore_eos=True))
    return sorted(comps, key=lambda c: (c.prompt_index, c.sample_index))


@pytest.fixture
def make_servicer(load_tiny, tmp_path) -> Iterator[Callable[..., object]]:
    """``make_servicer(**VerifierConfig fields)``: a ``VerifierServicer`` on a private copy of the
    model (its weights may be updated), mismatch store under ``tmp_path``; closed after the test."""
    from onpolicy.services.verifier.servicer import VerifierServicer
    from onpolicy.verification.config import VerifierConfig

    made = []

    def make(**config: object) -> object:
        config.setdefault("mismatch_dir", str(tmp_path / "mismatches"))
        sv = VerifierServicer(load_tiny(MODEL, kv_tile=KV_TILE, fresh=True), VerifierConfig(**config))
        made.append(sv)
        return sv

    yield make
    for sv in made:
        sv.close()
