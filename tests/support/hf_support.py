"""Helpers of the model tests: tiny random HF checkpoints of any config built in a test, compared
with transformers' own model and rolled out on our engine."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import transformers

from onpolicy.kernels import KernelConfig, get_backend
from onpolicy.models.registry import load_model
from onpolicy.models.tiny import byte_tokenizer, random_hf_model
from onpolicy.rollout import EngineConfig, RolloutEngine, SamplingParams
from onpolicy.trainer.forward import ScoredSequence, sequence_logprobs

TOL = 1e-4
BASE: dict[str, Any] = dict(vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                            num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-6, pad_token_id=256)


def build_hf(tmp: Path, family: str, seed: int = 7, **kwargs: Any) -> Path:
    """A tiny random HF checkpoint of ``family`` (biases random too) saved to ``tmp``."""
    model = random_hf_model(family, {**BASE, "max_position_embeddings": 256, **kwargs}, seed)
    model.save_pretrained(tmp)
    byte_tokenizer().save(str(tmp / "tokenizer.json"))
    return tmp


def hf_vs_ours(path: Path, lengths: tuple[int, ...] = (3, 70, 150)) -> float:
    """Max |Δ logprob| of transformers' model at ``path`` vs ours, over sequences of ``lengths``."""
    lm = load_model(str(path), get_backend(KernelConfig()))
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    gen = torch.Generator().manual_seed(0)
    worst = 0.0
    for n in lengths:
        ids = torch.randint(0, 320, (n + 1,), generator=gen)
        s = ScoredSequence(tuple(ids[:1].tolist()), tuple(ids[1:].tolist()), 1.0)
        with torch.no_grad():
            ours = sequence_logprobs(lm.model, [s])[0]
            ref = torch.log_softmax(hf(input_ids=ids[None]).logits[0].float(), -1)[:-1].gather(1, ids[1:, None])[:, 0]
        worst = max(worst, (ours - ref).abs().max().item())
    return worst


def rollout_equals_trainer(path: Path) -> None:
    lm = load_model(str(path), get_backend(KernelConfig(kv_tile=16)))
    prompts = [[(7 * i + j) % 300 for j in range(5 + 9 * i)] for i in range(4)]
    comps = RolloutEngine(lm, EngineConfig(max_num_seqs=3, max_batched_tokens=23)).generate(
        prompts, SamplingParams(temperature=1.0, max_new_tokens=40, seed=1, ignore_eos=True))
    seqs = [ScoredSequence(c.prompt_ids, c.token_ids, c.temperature) for c in comps]
    with torch.no_grad():
        trainer = sequence_logprobs(lm.model, seqs, pack_tokens=64)
    for c, t in zip(comps, trainer, strict=True):
        assert torch.equal(torch.tensor(c.logprobs, dtype=torch.float32), t)
