"""The training-path forward (``sequence_logprobs``): the same bits for any packing, with and without
autograd, for every family and dtype — and the same bits as an incremental rollout-style forward
(chunked prefill + batched paged decode) of the same model. Plus its input errors."""

from __future__ import annotations

import random
from collections.abc import Callable

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import Tensor

from onpolicy.kernels import AttentionBatch, PagedKV
from onpolicy.models.causal_lm import CausalLM
from onpolicy.trainer.forward import ScoredSequence, pack, sequence_logprobs

FAMILIES = ("tiny-llama", "tiny-qwen3", "tiny-qwen3-moe")
DTYPES = ("fp32", "bf16")
KV_TILE = 16


def make_seqs(seed: int, shapes: list[tuple[int, int]], vocab: int = 320, temps: bool = True) -> list[ScoredSequence]:
    rng = random.Random(seed)
    return [ScoredSequence(tuple(rng.randrange(vocab) for _ in range(p)), tuple(rng.randrange(vocab) for _ in range(c)),
                           rng.choice([1.0, 0.7, 1.3]) if temps else 1.0)
            for p, c in shapes]


# lengths cross the 16-position KV tile; one sequence is longer than the 7-row pack budget, one is
# a single prompt token with a single scored token
SHAPES = [(1, 1), (5, 12), (17, 3), (3, 30), (16, 1), (2, 2), (9, 25)]


def _equal_lists(a: list[Tensor], b: list[Tensor]) -> bool:
    return len(a) == len(b) and all(x.dtype == y.dtype and torch.equal(x, y) for x, y in zip(a, b, strict=True))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", FAMILIES)
def test_packing_invariance(load_tiny: Callable[..., object], name: str, dtype: str) -> None:
    model: CausalLM = load_tiny(name, dtype).model  # type: ignore[attr-defined]
    seqs = make_seqs(0, SHAPES)
    ref = sequence_logprobs(model, seqs, pack_tokens=4096)
    assert [t.shape[0] for t in ref] == [c for _, c in SHAPES]
    assert all(t.dtype == torch.float32 and bool((t <= 0).all()) and bool(torch.isfinite(t).all()) for t in ref)
    assert len(pack(seqs, 4096)) == 1 and len(pack(seqs, 1)) == len(seqs)
    for pack_tokens in (1, 7, 30, 64):
        assert _equal_lists(sequence_logprobs(model, seqs, pack_tokens=pack_tokens), ref), f"pack_tokens={pack_tokens}"
    # each sequence alone, and the batch in reverse order
    for i, s in enumerate(seqs):
        assert torch.equal(sequence_logprobs(model, [s])[0], ref[i])
    rev = sequence_logprobs(model, seqs[::-1])
    assert _equal_lists(rev[::-1], ref)


@pytest.mark.parametrize("dtype", DTYPES)
@settings(max_examples=12)
@given(seed=st.integers(0, 2**31 - 1), data=st.data())
def test_random_packings(load_tiny: Callable[..., object], dtype: str, seed: int, data: st.DataObject) -> None:
    name = data.draw(st.sampled_from(FAMILIES), label="family")
    model: CausalLM = load_tiny(name, dtype).model  # type: ignore[attr-defined]
    shape = st.tuples(st.integers(1, 20), st.integers(1, 20))
    shapes = data.draw(st.lists(shape, min_size=1, max_size=6), label="shapes")
    seqs = make_seqs(seed, shapes)
    ref = sequence_logprobs(model, seqs)
    order = data.draw(st.permutations(range(len(seqs))), label="order")
    budget = data.draw(st.integers(1, 120), label="pack_tokens")
    got = sequence_logprobs(model, [seqs[i] for i in order], pack_tokens=budget)
    for pos, i in enumerate(order):
        assert torch.equal(got[pos], ref[i]), f"seq {i} at {pos}, pack_tokens={budget}"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", FAMILIES)
def test_autograd_gives_same_bits(load_tiny: Callable[..., object], name: str, dtype: str) -> None:
    lm = load_tiny(name, dtype, fresh=True)
    model: CausalLM = lm.model  # type: ignore[attr-defined]
    seqs = make_seqs(1, SHAPES)
    with torch.no_grad():
        ref = sequence_logprobs(model, seqs, pack_tokens=4096)
    model.requires_grad_(True)
    with torch.enable_grad():
        for pack_tokens in (1, 7, 4096):
            out = sequence_logprobs(model, seqs, pack_tokens=pack_tokens)
            assert all(t.requires_grad for t in out)
            assert _equal_lists([t.detach() for t in out], ref), f"pack_tokens={pack_tokens}"
        # and the graph is usable: every parameter that the forward touches gets a finite gradient
        torch.stack([t.sum() for t in out]).sum().backward()
    grads = {n: p.grad for n, p in model.named_parameters()}
    assert grads["model.embed_tokens.weight"] is not None
    assert all(g is None or bool(torch.isfinite(g.float()).all()) for g in grads.values())
    # the no-grad path after training still gives the same bits (no stale cached LM-head copy)
    with torch.no_grad():
        assert _equal_lists(sequence_logprobs(model, seqs), ref)


def test_no_grad_lm_head_reads_the_stored_bf16_weight(load_tiny: Callable[..., object]) -> None:
    """bf16 LM head: without autograd the logprobs multiply by the weight as stored (widened inside the
    kernel) and give the bits of the fp32 copy the training path multiplies by; an in-place weight
    update is seen at once (nothing cached)."""
    from onpolicy.kernels.fast import FastBackend

    model: CausalLM = load_tiny("tiny-llama", "bf16", fresh=True).model  # type: ignore[attr-defined]
    assert model.lm_head is not None
    seqs = make_seqs(2, [(4, 6)])
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(5, model.config.hidden_size, generator=g).to(torch.bfloat16)
    temps = torch.tensor([1.0, 0.7, 1.3, 1.0, 2.0])
    with torch.no_grad():
        assert model.lm_head_weight() is model.lm_head.weight and model.lm_head.weight.dtype == torch.bfloat16
        stored = model.logprobs(hidden, temps)
        copied = model.ops.logprobs(hidden, model.lm_head_fp32(), temps)
        # negative control: torch's bf16 GEMM on the same stored weight rounds differently
        other = FastBackend(model.ops.config).logprobs(hidden, model.lm_head.weight, temps)
        before = sequence_logprobs(model, seqs)[0]
        model.lm_head.weight.mul_(2)
        after = sequence_logprobs(model, seqs)[0]
        model.lm_head.weight.div_(2)  # exact in bf16 (power of two)
        again = sequence_logprobs(model, seqs)[0]
    assert torch.equal(stored, copied)
    assert not torch.equal(other, copied)
    assert not torch.equal(before, after)
    assert torch.equal(before, again)
    # the training path (autograd) multiplies by the fp32 copy: the same bits
    assert _equal_lists(sequence_logprobs(model, seqs), [before])


@pytest.mark.parametrize("name", FAMILIES)
def test_temperature_is_per_sequence(load_tiny: Callable[..., object], name: str) -> None:
    model: CausalLM = load_tiny(name).model  # type: ignore[attr-defined]
    base = make_seqs(3, [(6, 10)], temps=False)[0]
    temps = [0.25, 1.0, 3.0]
    seqs = [ScoredSequence(base.prompt_ids, base.token_ids, t) for t in temps]
    packed = sequence_logprobs(model, seqs)
    for s, lp in zip(seqs, packed, strict=True):
        assert torch.equal(sequence_logprobs(model, [s])[0], lp)
    assert not torch.equal(packed[0], packed[1]) and not torch.equal(packed[1], packed[2])
    # temperature 1 vs T: log_softmax(z / T) — check against fp64 from the T=1 hidden logits
    with torch.no_grad():
        ids = torch.tensor([*base.prompt_ids, *base.token_ids[:-1]])
        from onpolicy.models.context import PackedContext

        ctx = PackedContext([len(ids)])
        h = model.hidden(ids, ctx.positions, ctx)[len(base.prompt_ids) - 1:]
        logits = h.double() @ model.lm_head_fp32().double().T
    for t, lp in zip(temps, packed, strict=True):
        want = torch.log_softmax(logits / t, -1).gather(1, torch.tensor(base.token_ids)[:, None])[:, 0]
        torch.testing.assert_close(lp.double(), want, atol=1e-5, rtol=0)


# --------------------------------------------------------------------------------- rollout-style path


class PagedCache:
    """Per-layer paged K/V of a few sequences, pages scattered, unwritten slots holding stale data."""

    def __init__(self, model: CausalLM, lens: list[int], page: int, gen: torch.Generator) -> None:
        cfg = model.config
        pages_per = [-(-n // page) for n in lens]
        total = sum(pages_per) + 2
        perm = torch.randperm(total, generator=gen)
        shape = (cfg.num_layers, total, page, cfg.num_kv_heads, cfg.head_dim)
        self.k = torch.randn(shape, generator=gen).to(model.dtype)
        self.v = torch.randn(shape, generator=gen).to(model.dtype)
        self.table = torch.full((len(lens), max(pages_per)), int(perm[-1]), dtype=torch.int64)
        used = 0
        for i, n in enumerate(pages_per):
            self.table[i, :n] = perm[used:used + n]
            used += n
        self.page = page


class PagedContext:
    """The attention context of one engine step: sequence ``ids[j]`` appends ``q_lens[j]`` rows
    at positions ``starts[j]..``; layers write their new K/V into the cache and read it back paged."""

    def __init__(self, cache: PagedCache, ids: list[int], starts: list[int], q_lens: list[int]) -> None:
        self.cache = cache
        self.batch = AttentionBatch.build(q_lens, starts, [a + n for a, n in zip(starts, q_lens, strict=True)])
        self.positions = torch.cat([torch.arange(a, a + n) for a, n in zip(starts, q_lens, strict=True)])
        slots = [(int(cache.table[i, p // cache.page]), p % cache.page)
                 for i, a, n in zip(ids, starts, q_lens, strict=True) for p in range(a, a + n)]
        self.slot_page = torch.tensor([s[0] for s in slots])
        self.slot_off = torch.tensor([s[1] for s in slots])
        self.table = cache.table[ids]

    def kv(self, layer: int, k: Tensor, v: Tensor) -> PagedKV:
        kp, vp = self.cache.k[layer], self.cache.v[layer]
        kp[self.slot_page, self.slot_off] = k
        vp[self.slot_page, self.slot_off] = v
        return PagedKV(kp, vp, self.table)


def rollout_logprobs(model: CausalLM, seqs: list[ScoredSequence], chunk: list[int], page: int,
                     seed: int) -> list[Tensor]:
    """Score ``seqs`` like an inference engine: every step, each live sequence either prefills its
    next prompt chunk (``chunk[i]`` rows) or decodes one token; all live sequences share the step."""
    inputs = [[*s.prompt_ids, *s.token_ids[:-1]] for s in seqs]
    cache = PagedCache(model, [len(x) for x in inputs], page, torch.Generator().manual_seed(seed))
    done = [0] * len(seqs)
    scored: list[list[Tensor]] = [[] for _ in seqs]
    with torch.no_grad():
        while True:
            live = [i for i in range(len(seqs)) if done[i] < len(inputs[i])]
            if not live:
                break
            q_lens = [min(chunk[i], len(seqs[i].prompt_ids) - done[i]) if done[i] < len(seqs[i].prompt_ids) else 1
                      for i in live]
            starts = [done[i] for i in live]
            ctx = PagedContext(cache, live, starts, q_lens)
            ids = torch.tensor([t for i, a, n in zip(live, starts, q_lens, strict=True) for t in inputs[i][a:a + n]])
            hidden = model.hidden(ids, ctx.positions, ctx)
            rows, targets, temps, owners = [], [], [], []
            r = 0
            for i, a, n in zip(live, starts, q_lens, strict=True):
                for p in range(a, a + n):  # the row at position p predicts token p + 1
                    t = p + 1 - len(seqs[i].prompt_ids)
                    if t >= 0:
                        rows.append(r)
                        targets.append(seqs[i].token_ids[t])
                        temps.append(seqs[i].temperature)
                        owners.append(i)
                    r += 1
                done[i] += n
            if rows:
                lp = model.logprobs(hidden[torch.tensor(rows)], torch.tensor(temps, dtype=torch.float32))
                tok = lp.gather(1, torch.tensor(targets)[:, None])[:, 0]
                for i, value in zip(owners, tok, strict=True):
                    scored[i].append(value.reshape(1))
    return [torch.cat(x) for x in scored]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", FAMILIES)
def test_training_path_equals_rollout_path(load_tiny: Callable[..., object], name: str, dtype: str) -> None:
    """The heart of the contract at model level: teacher-forced training logprobs are bitwise the
    logprobs an engine computes with chunked prefill + batched paged decode (logdiff = 0)."""
    model: CausalLM = load_tiny(name, dtype).model  # type: ignore[attr-defined]
    seqs = make_seqs(4, [(20, 14), (3, 22), (1, 5), (33, 2)])
    ref = sequence_logprobs(model, seqs)
    for chunk, page in (([7, 1, 4, 16], KV_TILE), ([64, 64, 64, 5], 2 * KV_TILE)):
        got = rollout_logprobs(model, seqs, chunk, page, seed=len(chunk) + page)
        for i, (a, b) in enumerate(zip(got, ref, strict=True)):
            assert torch.equal(a, b), f"seq {i}, chunks {chunk}, page {page}: max |diff| {(a - b).abs().max().item()}"


def test_fast_backend_training_path_differs_from_rollout_path(load_tiny: Callable[..., object]) -> None:
    """With the fast (non-invariant) kernels the two paths do NOT agree bitwise (but stay close):
    the mismatch the consistent operator set exists to remove."""
    model: CausalLM = load_tiny("tiny-llama", "fp32", backend="fast").model  # type: ignore[attr-defined]
    seqs = make_seqs(4, [(20, 14), (3, 22), (1, 5), (33, 2)])
    ref = sequence_logprobs(model, seqs)
    got = rollout_logprobs(model, seqs, [7, 1, 4, 16], KV_TILE, seed=0)
    assert any(not torch.equal(a, b) for a, b in zip(got, ref, strict=True))
    for a, b in zip(got, ref, strict=True):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=0)


# --------------------------------------------------------------------------------------------- packing


def test_pack_is_greedy_in_order() -> None:
    seqs = [ScoredSequence((1,) * p, (2,) * c) for p, c in [(3, 3), (2, 1), (10, 1), (1, 1), (1, 1)]]
    # input lengths 5, 2, 10, 1, 1
    assert pack(seqs, 7) == [[0, 1], [2], [3, 4]]
    assert pack(seqs, 1) == [[0], [1], [2], [3], [4]]
    assert pack(seqs, 100) == [[0, 1, 2, 3, 4]]
    assert pack([], 5) == []
    with pytest.raises(ValueError, match="pack_tokens"):
        pack(seqs, 0)


def test_input_len_excludes_last_target() -> None:
    assert ScoredSequence((1, 2, 3), (4, 5)).input_len == 4
    assert ScoredSequence((1,), (2,)).input_len == 1


# ---------------------------------------------------------------------------------------------- errors


@pytest.mark.parametrize("bad", [-1, 320, 10**9])
@pytest.mark.parametrize("where", ["prompt", "tokens"])
def test_token_ids_outside_vocab_rejected(load_tiny: Callable[..., object], bad: int, where: str) -> None:
    model = load_tiny("tiny-qwen3").model  # type: ignore[attr-defined]
    good = ScoredSequence((1, 2), (3,))
    s = ScoredSequence((1, bad), (3,)) if where == "prompt" else ScoredSequence((1, 2), (3, bad))
    with pytest.raises(ValueError, match=r"sequence 1: token id .* outside the vocabulary \[0, 320\)"):
        sequence_logprobs(model, [good, s])


@pytest.mark.parametrize(("prompt", "tokens"), [((), (1,)), ((1,), ()), ((), ())])
def test_empty_prompt_or_tokens_rejected(prompt: tuple[int, ...], tokens: tuple[int, ...]) -> None:
    with pytest.raises(ValueError, match="must not be empty"):
        ScoredSequence(prompt, tokens)


@pytest.mark.parametrize("temperature", [0.0, -0.0, -1.0, float("nan"), float("-inf")])
def test_non_positive_temperature_rejected(temperature: float) -> None:
    with pytest.raises(ValueError, match="temperature"):
        ScoredSequence((1,), (2,), temperature)


def test_sequence_longer_than_max_positions_rejected(load_tiny: Callable[..., object]) -> None:
    model = load_tiny("tiny-llama").model  # type: ignore[attr-defined]
    n = model.config.max_position_embeddings
    sequence_logprobs(model, [ScoredSequence((5,) * (n - 1), (6, 7))], pack_tokens=1)  # exactly fits
    with pytest.raises(ValueError, match="max_position_embeddings"):
        sequence_logprobs(model, [ScoredSequence((5,) * n, (6, 7))])
