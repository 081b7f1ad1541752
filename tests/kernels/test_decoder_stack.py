"""The reference backend's whole-stack call (``kernels/cpu/stack.c``) and the packed weights it
reads for few rows (``rowdot_packed``: fp32, and pair-packed bf16) give the bits of the per-operator path: the
same hidden states, the same K/V cache contents, the same sampled tokens and logprobs, for prefill,
mixed and decode steps, Llama and Qwen3, fp32 and bf16, with and without attention biases; the
trainer's autograd path agrees; anything the stack does not describe takes the per-operator path.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from onpolicy.kernels import AttentionBatch, KernelConfig, cpu, get_backend
from onpolicy.kernels.cpu.stack import decoder_stack
from onpolicy.models.causal_lm import CausalLM
from onpolicy.models.layers import dense_stack
from onpolicy.rollout.kv_cache import KVCache, PagedContext

PAGE = 16
needs_vector = pytest.mark.skipif(not cpu.vector_path(), reason="the packed kernel runs on the AVX2 path only")


# ---- rowdot_packed: packed fp32 and pair-packed bf16 weights ------------------------------------

@needs_vector
@pytest.mark.parametrize("xd,wd", [(torch.float32, torch.bfloat16), (torch.bfloat16, torch.bfloat16),
                                   (torch.float32, torch.float32), (torch.bfloat16, torch.float32)])
@pytest.mark.parametrize("chunks", [1, 4])
@pytest.mark.parametrize("m", [1, 3, 5])
@pytest.mark.parametrize("n", [1, 8, 9, 97])
def test_packed_weights_give_the_chunked_rowdot_bits(xd: torch.dtype, wd: torch.dtype, chunks: int, m: int,
                                                     n: int) -> None:
    gen = torch.Generator().manual_seed(m * 100 + n + chunks)
    k = (16 if wd == torch.bfloat16 else 8) * chunks * 3
    w = (torch.randn(n, k, generator=gen) * 3).to(wd)
    x = (torch.randn(m, k, generator=gen) * 3).to(xd)
    w[0, 5], x[0, 7], x[-1, 3] = float("inf"), -0.0, 1e30  # a non-finite product stays in its own row
    round_bf16 = xd == torch.bfloat16
    want = cpu.rowdot_chunks(x, w.view(n, chunks, k // chunks).transpose(0, 1).contiguous(), fold=True,
                                round_bf16=round_bf16)
    packed = cpu.pack(w, chunks)
    for threads in (1, 2, 3):
        got = cpu.rowdot_packed(x, [(packed, n)], chunks=chunks, round_bf16=round_bf16, threads=threads)[0]
        assert torch.equal(got.nan_to_num(nan=7.0), want.nan_to_num(nan=7.0))
        assert torch.equal(got.isnan(), want.isnan())


@needs_vector
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_packed_group_gives_each_weight_its_own_bits(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(2, 64, generator=gen).to(dtype)
    ws = [torch.randn(n, 64, generator=gen).to(dtype) for n in (24, 8, 13)]
    ys = cpu.rowdot_packed(x, [(cpu.pack(w), w.shape[0]) for w in ws])
    for w, y in zip(ws, ys, strict=True):
        assert torch.equal(y, cpu.rowdot(x, w))


@pytest.mark.parametrize("weight,chunks", [(torch.zeros(8, 24, dtype=torch.bfloat16), 1),
                                           (torch.zeros(8, 32, dtype=torch.bfloat16), 4),
                                           (torch.zeros(8, 12), 1), (torch.zeros(8, 16), 4),
                                           (torch.zeros(8, 32, dtype=torch.float16), 1)])
def test_unpackable_weights_are_refused_clearly(weight: torch.Tensor, chunks: int) -> None:
    assert not cpu.packable(weight, chunks)
    with pytest.raises(ValueError, match="pack takes"):
        cpu.pack(weight, chunks)


@needs_vector
def test_a_packed_weight_of_the_wrong_size_is_refused() -> None:
    x = torch.zeros(1, 32, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="has 128 elements"):
        cpu.rowdot_packed(x, [(torch.zeros(10, dtype=torch.int32), 8)])


# ---- decoder_stack through whole models --------------------------------------------------------

def _model(family: str, dtype: str, load_tiny, bias: bool = False) -> CausalLM:
    """A fresh tiny model; with ``bias`` a copy of its config with attention biases, random weights."""
    lm = load_tiny(family, dtype, kv_tile=PAGE, fresh=True)
    if not bias:
        return lm.model
    model = CausalLM(replace(lm.model.config, attention_bias=True), lm.model.ops)
    gen = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(1 + 0.1 * torch.randn(p.shape, generator=gen) if "norm" in name
                    else 0.2 * torch.randn(p.shape, generator=gen))
    return model.to(lm.model.dtype)


def _steps(model: CausalLM, seqs: list[list[int]], stacked: bool) -> tuple[list[torch.Tensor], KVCache]:
    """Hidden states of three engine-like steps over a fresh paged cache (sequence s on pages s*4..):
    a prefill of every sequence but its last 2 tokens, then one token of each, then one of the first;
    ``stacked``: with the model's stack taken once up front, as an engine does at load time."""
    cache = KVCache(model.config.num_layers, 4 * len(seqs), PAGE, model.num_local_kv_heads, model.config.head_dim,
                    model.dtype)
    done = [len(s) - 2 for s in seqs]
    plan = [[(s, 0, done[s]) for s in range(len(seqs))], [(s, done[s], 1) for s in range(len(seqs))],
            [(0, done[0] + 1, 1)]]
    stack = model.dense_stack() if stacked else None
    assert stack is not None or not stacked
    outs = []
    for step in plan:
        ids = [t for s, a, n in step for t in seqs[s][a:a + n]]
        pos = [p for _, a, n in step for p in range(a, a + n)]
        slots = [s * 4 * PAGE + p for s, a, n in step for p in range(a, a + n)]
        batch = AttentionBatch.build([n for _, _, n in step], [a for _, a, _ in step], [a + n for _, a, n in step])
        table = torch.tensor([[s * 4 + j for j in range(4)] for s, _, _ in step])
        ctx = PagedContext(cache, batch, table, torch.tensor(slots))
        with torch.no_grad():
            outs.append(model.hidden(torch.tensor(ids), torch.tensor(pos), ctx, stack=stack))
    return outs, cache


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("family,bias", [("tiny-llama", False), ("tiny-qwen3", False), ("tiny-llama", True)])
def test_the_stack_gives_the_per_operator_bits_and_cache(load_tiny, family: str, dtype: str, bias: bool) -> None:
    model = _model(family, dtype, load_tiny, bias)
    gen = torch.Generator().manual_seed(1)
    seqs = [torch.randint(0, 256, (n,), generator=gen).tolist() for n in (9, 20, 5)]
    calls: list[bool] = []
    real = model.ops.decoder_stack

    def spy(*args, **kwargs):
        out = real(*args, **kwargs)
        calls.append(out is not None)
        return out

    model.ops.decoder_stack = spy
    try:
        stacked, cache_a = _steps(model, seqs, stacked=True)
    finally:
        del model.ops.decoder_stack
    assert calls == [True, True, True]  # prefill (13 + 18 + 3 rows), 3 decode rows, 1 decode row
    per_op, cache_b = _steps(model, seqs, stacked=False)
    for a, b in zip(stacked, per_op, strict=True):
        assert torch.equal(a, b)
    assert torch.equal(cache_a.k, cache_b.k) and torch.equal(cache_a.v, cache_b.v)
    # and a whole-sequence training forward (packed context, per-operator path) gives the same rows
    from onpolicy.models.context import PackedContext
    full = seqs[0]
    with torch.no_grad():
        trained = model.hidden(torch.tensor(full), torch.arange(len(full)), PackedContext([len(full)]))
    assert torch.equal(trained[-1], stacked[2][0]) and torch.equal(trained[-2], stacked[1][0])


def test_the_stack_is_thread_count_and_path_independent(load_tiny) -> None:
    model = _model("tiny-qwen3", "bf16", load_tiny)
    stack = dense_stack(model.config, model.model.layers)
    assert stack is not None
    gen = torch.Generator().manual_seed(2)
    n = 3
    cache = KVCache(model.config.num_layers, 4, PAGE, model.num_local_kv_heads, model.config.head_dim, model.dtype)
    batch = AttentionBatch.build([1] * n, [0] * n, [1] * n)
    ctx = PagedContext(cache, batch, torch.tensor([[0], [1], [2]]), torch.tensor([0, PAGE, 2 * PAGE]))
    x = model.model.embed_tokens(torch.randint(0, 256, (n,), generator=gen)).detach()
    cos, sin = model.rope_cos[:1].expand(n, -1), model.rope_sin[:1].expand(n, -1)
    with torch.no_grad():
        runs = [decoder_stack(x, stack, cos, sin, ctx.cache_write, batch, kv_tile=PAGE, chunks=4, threads=t,
                              portable=p) for t, p in ((1, False), (2, False), (3, False), (2, True))]
    for r in runs[1:]:
        assert r is not None and torch.equal(r, runs[0])


def test_the_stack_declines_what_it_does_not_describe(load_tiny) -> None:
    moe = _model("tiny-qwen3-moe", "fp32", load_tiny)
    assert dense_stack(moe.config, moe.model.layers) is None
    model = _model("tiny-llama", "fp32", load_tiny)
    stack = dense_stack(model.config, model.model.layers)
    assert stack is not None
    cache = KVCache(model.config.num_layers, 2, PAGE, model.num_local_kv_heads, model.config.head_dim, model.dtype)
    batch = AttentionBatch.build([1], [0], [1])
    ctx = PagedContext(cache, batch, torch.tensor([[0]]), torch.tensor([0]))
    x = torch.zeros(1, model.config.hidden_size)
    cos, sin = model.rope_cos[:1], model.rope_sin[:1]
    with torch.enable_grad():  # autograd on: the per-operator path (the stack has no backward)
        assert decoder_stack(x, stack, cos, sin, ctx.cache_write, batch, kv_tile=PAGE, chunks=4) is None
    with torch.no_grad():
        assert decoder_stack(x.half(), stack, cos, sin, ctx.cache_write, batch, kv_tile=PAGE, chunks=4) is None
        assert decoder_stack(x, stack, cos, sin, ctx.cache_write, batch, kv_tile=PAGE, chunks=4) is not None
        with pytest.raises(ValueError, match="cache slots"):
            bad = PagedContext(cache, batch, torch.tensor([[0]]), torch.tensor([10**6]))
            decoder_stack(x, stack, cos, sin, bad.cache_write, batch, kv_tile=PAGE, chunks=4)
    # a backend without the call (fast; also the doctor's capture) inherits the default: None
    assert get_backend(KernelConfig(backend="fast")).decoder_stack(x, stack, cos, sin, ctx.cache_write, batch) is None


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_rollout_with_the_stack_equals_the_trainer_path(load_tiny, dtype: str) -> None:
    from onpolicy.rollout import EngineConfig, RolloutEngine, SamplingParams
    from onpolicy.trainer.forward import ScoredSequence, sequence_logprobs

    lm = load_tiny("tiny-qwen3", dtype, kv_tile=PAGE, fresh=True)
    prompts = [[5, 9, 11, 3, 200, 17, 4], [7, 8] * 20, [1, 2, 3]]
    engine = RolloutEngine(lm, EngineConfig(max_num_seqs=4, max_batched_tokens=24, kv_cache_tokens=512))
    comps = engine.generate(prompts, SamplingParams(temperature=1.0, max_new_tokens=12, ignore_eos=True))
    lm.model.requires_grad_(True)
    trained = sequence_logprobs(lm.model, [ScoredSequence(c.prompt_ids, c.token_ids, c.temperature) for c in comps])
    for c, t in zip(comps, trained, strict=True):
        assert torch.equal(torch.tensor(c.logprobs), t.detach())


def test_the_stack_follows_replaced_and_updated_parameters(load_tiny) -> None:
    model = _model("tiny-llama", "bf16", load_tiny)
    gen = torch.Generator().manual_seed(4)
    seqs = [torch.randint(0, 256, (n,), generator=gen).tolist() for n in (7, 6)]
    before, _ = _steps(model, seqs, stacked=True)
    with torch.no_grad():  # an in-place update (a weight sync: copy_) of one weight
        model.model.layers[0].mlp.gate_proj.weight.mul_(2)
    updated, _ = _steps(model, seqs, stacked=True)
    assert torch.equal(updated[1], _steps(model, seqs, stacked=False)[0][1])
    assert not torch.equal(updated[1], before[1])
    # parameters replaced by new objects (load_state_dict(assign=True)): a stack taken afterwards holds them
    state = {k: v.clone() * (0.5 if k.endswith("q_proj.weight") else 1) for k, v in model.state_dict().items()}
    model.load_state_dict(state, assign=True)
    replaced, _ = _steps(model, seqs, stacked=True)
    for a, b in zip(replaced, _steps(model, seqs, stacked=False)[0], strict=True):
        assert torch.equal(a, b)
    assert not torch.equal(replaced[1], updated[1])


def test_the_engine_takes_the_stack_once_at_load_time(load_tiny) -> None:
    from onpolicy.rollout import EngineConfig, RolloutEngine

    config = EngineConfig(kv_cache_tokens=64)
    assert RolloutEngine(load_tiny("tiny-llama", kv_tile=PAGE), config).runner.stack is not None
    assert RolloutEngine(load_tiny("tiny-qwen3-moe", kv_tile=PAGE), config).runner.stack is None


def test_overridden_operators_and_a_runner_without_stack_take_the_per_operator_path(load_tiny) -> None:
    from onpolicy.kernels.reference import ReferenceBackend

    class Doubled(ReferenceBackend):
        def rmsnorm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
            return super().rmsnorm(x, weight, eps) * 2

    model = _model("tiny-llama", "fp32", load_tiny)
    stack = dense_stack(model.config, model.model.layers)
    cache = KVCache(model.config.num_layers, 2, PAGE, model.num_local_kv_heads, model.config.head_dim, model.dtype)
    batch = AttentionBatch.build([1], [0], [1])
    ctx = PagedContext(cache, batch, torch.tensor([[0]]), torch.tensor([0]))
    x = torch.zeros(1, model.config.hidden_size)
    with torch.no_grad():
        assert Doubled(model.ops.config).decoder_stack(x, stack, model.rope_cos[:1], model.rope_sin[:1],
                                                       ctx.cache_write, batch) is None
    seen: list[str] = []
    handle = model.model.layers[1].mlp.register_forward_hook(lambda m, i, o: seen.append("mlp"))
    try:
        calls: list[object] = []
        model.ops.decoder_stack = lambda *a, **k: calls.append(a)  # type: ignore[method-assign]
        try:
            _steps(model, [[1, 2, 3, 4]], stacked=False)
            assert not calls and seen == ["mlp"] * 3  # without a stack every module runs, once per step
            _steps(model, [[1, 2, 3, 4]], stacked=True)
            assert len(calls) == 3  # with one, the layers are one call per step
        finally:
            del model.ops.decoder_stack
    finally:
        handle.remove()
