"""The reference backend's shortcuts give the bits of the general path (docs/performance.md):

- a paged cache with a zero row (the rollout cache's reserved page) vs zeroing V past each end;
- decode-shaped batches (every sequence the same query count: grouping by reshape) vs ragged ones;
- the tile routine's skipped padding rows vs computing them;
- the LM head without autograd vs with it (a plain rowdot call vs its autograd function);
- q/k/v and gate/up as one ``rowdot_group`` call vs one call per projection module, and vs the
  autograd path (one ``_Rowdot`` per linear), through a whole model.
"""

from __future__ import annotations

import pytest
import torch

from onpolicy.kernels import AttentionBatch, ContiguousKV, KernelConfig, PagedKV, get_backend
from onpolicy.kernels.spec.attention import tile_attention

D = 16


def _paged(lens: list[int], hkv: int, page: int, dtype: torch.dtype, gen: torch.Generator,
           ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, list[torch.Tensor], list[torch.Tensor]]:
    """Pages holding each sequence's K/V (scattered, stale garbage elsewhere) plus a last all-zero page."""
    per = [-(-n // page) for n in lens]
    total = sum(per) + 2
    kp = (torch.randn(total + 1, page, hkv, D, generator=gen) * 50).to(dtype)
    vp = (torch.randn(total + 1, page, hkv, D, generator=gen) * 50).to(dtype)
    kp[total], vp[total] = 0, 0
    perm = torch.randperm(total, generator=gen)
    table = torch.full((len(lens), max(per) + 1), int(perm[-1]), dtype=torch.int64)
    ks, vs, used = [], [], 0
    for i, (n, m) in enumerate(zip(lens, per, strict=True)):
        table[i, :m] = perm[used:used + m]
        used += m
        k, v = torch.randn(n, hkv, D, generator=gen).to(dtype), torch.randn(n, hkv, D, generator=gen).to(dtype)
        for p in range(n):
            kp[table[i, p // page], p % page], vp[table[i, p // page], p % page] = k[p], v[p]
        ks.append(k)
        vs.append(v)
    return kp, vp, table, ks, vs


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("hkv,g", [(1, 3), (3, 3), (2, 1)])
def test_zero_row_decode_and_prefill_equal_training(dtype: torch.dtype, hkv: int, g: int) -> None:
    ops = get_backend(KernelConfig(kv_tile=16, compute_dtype="bf16" if dtype == torch.bfloat16 else "fp32"))
    gen = torch.Generator().manual_seed(hkv * 10 + g)
    lens = [1, 15, 16, 17, 40, 70]
    kp, vp, table, ks, vs = _paged(lens, hkv, 32, dtype, gen)
    zero = (kp.shape[0] - 1) * 32
    qs = [torch.randn(n, hkv * g, D, generator=gen).to(dtype) for n in lens]
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()])
    train = ops.attention(torch.cat(qs), ContiguousKV(torch.cat(ks), torch.cat(vs), cu),
                          AttentionBatch.build(lens, [0] * len(lens), lens), D ** -0.5).split(lens)
    with torch.no_grad():
        for row in range(max(lens)):  # decode steps: every live sequence one query (uniform batch)
            live = [i for i, n in enumerate(lens) if row < n]
            b = AttentionBatch.build([1] * len(live), [row] * len(live), [row + 1] * len(live))
            q = torch.cat([qs[i][row:row + 1] for i in live])
            for kv in (PagedKV(kp, vp, table[live], zero_row=zero), PagedKV(kp, vp, table[live])):
                out = ops.attention(q, kv, b, D ** -0.5)
                for j, i in enumerate(live):
                    assert torch.equal(out[j], train[i][row]), f"seq {i} position {row}"
        # ragged chunked prefill of the last rows (non-uniform batch) over the same pages
        q_lens = [max(1, n // 3) for n in lens]
        starts = [n - m for n, m in zip(lens, q_lens, strict=True)]
        b = AttentionBatch.build(q_lens, starts, lens)
        q = torch.cat([qs[i][a:] for i, a in enumerate(starts)])
        out = ops.attention(q, PagedKV(kp, vp, table, zero_row=zero), b, D ** -0.5).split(q_lens)
        for i, a in enumerate(starts):
            assert torch.equal(out[i], train[i][a:])


def test_tile_skipping_padding_rows_keeps_the_other_rows_bits() -> None:
    gen = torch.Generator().manual_seed(3)
    s, hkv, r, length = 4, 3, 8, 128
    q, k, v = (torch.randn(s, hkv, n, D, generator=gen) for n in (r, length, length))
    pos = torch.randint(0, length, (s, 1, r), generator=gen)
    with torch.no_grad():
        full = tile_attention(q, k, v, pos, 0.25, 64)
        for keep in (1, 3, 5, 8):
            assert torch.equal(tile_attention(q, k, v, pos, 0.25, 64, rows=keep), full[:, :, :keep])


@pytest.mark.parametrize("rows", [1, 8, 13, 32])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_lm_head_without_autograd_equals_autograd(rows: int, dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(rows)
    w = (torch.randn(2348, 64, generator=gen) * 0.05).to(dtype)
    x = torch.randn(rows, 64, generator=gen).to(dtype)
    ops = get_backend(KernelConfig(compute_dtype="bf16" if dtype == torch.bfloat16 else "fp32"))
    t = torch.rand(rows, generator=gen) + 0.3
    with torch.no_grad():
        plain = ops.logprobs(x, w, t)
    trained = ops.logprobs(x.clone().requires_grad_(), w, t)
    assert trained.requires_grad and torch.equal(plain, trained.detach())
    # a bf16 head is widened inside rowdot: the bits of an fp32 copy of it
    assert torch.equal(plain, ops.logprobs(x, w.float(), t))


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("family", ["tiny-llama", "tiny-qwen3", "tiny-qwen3-moe"])
def test_grouped_projections_give_the_per_module_bits(load_tiny, family: str, dtype: str) -> None:
    from onpolicy.trainer.forward import ScoredSequence, sequence_logprobs

    lm = load_tiny(family, dtype, fresh=True)
    gen = torch.Generator().manual_seed(11)
    seqs = [ScoredSequence(tuple(torch.randint(0, 256, (n,), generator=gen).tolist()),
                           tuple(torch.randint(0, 256, (m,), generator=gen).tolist())) for n, m in ((5, 9), (17, 3))]
    ops = lm.model.ops
    assert ops.groups_projections
    with torch.no_grad():
        grouped = sequence_logprobs(lm.model, seqs)
        ops.groups_projections = False  # this instance only
        per_module = sequence_logprobs(lm.model, seqs)
    del ops.groups_projections
    lm.model.requires_grad_(True)
    trained = sequence_logprobs(lm.model, seqs)
    assert trained[0].requires_grad
    for a, b, c in zip(grouped, per_module, trained, strict=True):
        assert torch.equal(a, b) and torch.equal(a, c.detach())
