"""Fixtures of the doctor tests: a model loader sharing the session's tiny models, and a mismatch
store of real samples produced by ``onpolicy generate --json`` on tiny-qwen3."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from doctor_support import run_cli, store_sample

from onpolicy.trainer.forward import ScoredSequence, sequence_logprobs


@pytest.fixture(scope="session")
def loader(load_tiny: Callable[..., object]) -> Callable[[str, str], object]:
    """``diagnose(loader=...)``: the session's shared tiny models (the doctor never mutates them)."""
    return lambda ref, dtype: load_tiny(ref, compute_dtype=dtype)


@pytest.fixture(scope="session")
def generated(tiny_paths: dict[str, Path]) -> dict[str, dict]:
    """``generate --json`` outputs: two samples with fast kernels (batched), one with consistent ones."""
    out = {}
    for kernels, n in (("fast", 2), ("consistent", 1)):
        proc = run_cli(["generate", "--model", "tiny-qwen3", "--prompt", "Tell me a story", "--n", str(n),
                        "--max-new-tokens", "8", "--kv-tile", "16", "--kernels", kernels, "--seed", "5", "--json"])
        assert proc.returncode == 0, proc.stderr[-2000:]
        out[kernels] = json.loads(proc.stdout)
    return out


@pytest.fixture(scope="session")
def store(generated: dict[str, dict], load_tiny: Callable[..., object], tmp_path_factory: pytest.TempPathFactory,
          ) -> Path:
    """A mismatch store (``<dir>/<job>/step*.json``) of those three samples, with trainer logprobs
    recomputed on the training path (reference kernels, KV tile 16)."""
    root = tmp_path_factory.mktemp("mismatches")
    lm = load_tiny("tiny-qwen3", kv_tile=16)
    step = 0
    for kernels, gen in generated.items():
        for i, c in enumerate(gen["completions"]):
            seq = ScoredSequence(tuple(c["prompt_ids"]), tuple(c["token_ids"]), c["temperature"])
            with torch.no_grad():
                (lp,) = sequence_logprobs(lm.model, [seq])  # type: ignore[attr-defined]
            sample = store_sample(gen, i, f"job-{kernels}", step, [float(x) for x in lp.tolist()])
            path = root / f"job-{kernels}" / f"step{step:06d}-{kernels}{i}.json"
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps(sample))
            step += 1
    return root
