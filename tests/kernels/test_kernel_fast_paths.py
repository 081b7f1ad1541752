"""The reference backend's shortcuts give the bits of the general path (docs/performance.md):

- a paged cache with a zero row (the rollout cache's reserved page) vs zeroing V past each end;
- decode-shaped batches (every sequence the same query count: grouping by reshape) vs ragged ones;
- the tile routine's skipped padding rows vs computing them;
- the LM head in column chunks without autograd vs one GEMM with autograd.
"""

from __future__ import annotations

import itertools

import pytest
import torch

from onpolicy.kernels import AttentionBatch, ContiguousKV, KernelConfig, PagedKV, get_backend
from onpolicy.kernels.reference.attention import tile_attention
from onpolicy.kernels.reference.linear import (
    COLUMN_CHUNK,
    MIN_COLUMNS,
    column_chunked_linear,
    column_chunks,
    tiled_linear,
)

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


def test_column_chunks_cover_without_narrow_calls() -> None:
    for out in (2 * COLUMN_CHUNK, 2 * COLUMN_CHUNK + 1, 2 * COLUMN_CHUNK + 300, 49152, 151936):
        ranges = column_chunks(out)
        assert ranges[0][0] == 0 and ranges[-1][1] == out
        assert all(a == b for (_, a), (b, _) in itertools.pairwise(ranges))
        assert all(b - a >= max(MIN_COLUMNS, COLUMN_CHUNK // 4) for a, b in ranges)


@pytest.mark.parametrize("rows", [1, 8, 13, 32])
def test_column_chunked_lm_head_equals_one_gemm_and_autograd(rows: int) -> None:
    gen = torch.Generator().manual_seed(rows)
    w = torch.randn(2 * COLUMN_CHUNK + 300, 64, generator=gen) * 0.05
    x = torch.randn(rows, 64, generator=gen)
    assert torch.equal(column_chunked_linear(x, w, 8), tiled_linear(x, w, 8))
    ops = get_backend(KernelConfig())
    t = torch.rand(rows, generator=gen) + 0.3
    with torch.no_grad():
        plain = ops.logprobs(x, w, t)
    trained = ops.logprobs(x.clone().requires_grad_(), w, t)
    assert trained.requires_grad and torch.equal(plain, trained.detach())
