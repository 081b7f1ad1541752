"""The Ascend attention kernel's loop structure agrees with the reference backend on the order of
additions, bit for bit.

``kernels/ascendc/replay/attention_replay.cpp`` is the tile loop of ``op_kernel/attention_tile.h``
written as plain C++ (compiled with -ffp-contract=off), driven by the plan of the shared host tiling
(``common/tile_plan.cpp``). Two checks:

* **oracle replay** — the hardware primitives (the two Cube GEMMs, exp, the per-tile row sum) are
  supplied by torch: the GEMM results are slices of the reference backend's own GEMMs, after the
  replay proves it hands them bit-identical inputs (the gathered Q block and the probability tile
  P), and exp / row sum are torch ops applied to the replay's own buffers. Everything order-
  sensitive — masking, tile max, running max, S - m, the l/acc recurrence (two roundings each,
  no FMA), the skipped tiles, the final divide — is the replay's. Output == reference output
  (``torch.equal``) for training, prefill, chunked prefill and paged decode views, fp32 and bf16,
  GQA 1/2/4, lengths crossing tile boundaries.
* **native replay** — the same loop with its own primitives (fixed-order dot products, expf, the
  kernel's 64-lane fold + tree row sum): every view of the same tokens gives identical bits, and
  they are close to the reference (different primitives, so not bitwise).

What this does NOT prove: that the Cube's GEMMs, the vector unit's Exp, and WholeReduceSum on an
NPU give the same bits for the same inputs in training and inference calls — that follows from
identical instruction sequences with identical shapes and is checked on hardware by test_ascend_npu.py.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

import numpy as np
import pytest
import torch
from ascend_cpu_support import EXP_FN, PV_FN, QK_FN, ROWSUM_FN, Hooks, NativeLib, Plan, as_tensor, paged_cache

import onpolicy.kernels.spec.attention as ref_attention
from onpolicy.kernels import AttentionBatch, ContiguousKV, KernelConfig, PagedKV, get_backend


@dataclass
class Captured:
    """Intermediates of the reference tile routine, recomputed from its exact arguments."""

    qd: torch.Tensor       # [S, Hkv, R, D] fp32 query rows
    raw: torch.Tensor      # [S, Hkv, R, L] q @ k^T (the first GEMM, before scale)
    p: torch.Tensor        # [S, Hkv, R, nb, kv_tile] probabilities
    pv: torch.Tensor       # [S, Hkv, nb, R, D] the second GEMM


def reference_with_intermediates(q, kv, batch, scale, row_tile, kv_tile) -> tuple[torch.Tensor, Captured]:
    """Run the reference backend's attention, capturing the tile routine's inputs."""
    calls = []
    original = ref_attention.tile_attention

    def spy(qd, k, v, pos, scale_, kv_tile_):
        calls.append((qd, k, v, pos, scale_, kv_tile_))
        return original(qd, k, v, pos, scale_, kv_tile_)

    out = ref_attention.attention(q, kv, batch, scale, row_tile=row_tile, kv_tile=kv_tile, tile=spy)
    assert len(calls) == 1, "keep test shapes below the reference's chunking budget"
    qd, k, v, pos, scale_, kt = calls[0]
    # The reference's own expressions, in its order (kernels/spec/attention.py).
    s, hkv, r, d = qd.shape
    length = k.shape[2]
    nb = length // kt
    raw = qd.float() @ k.float().transpose(2, 3)
    scores = (raw * scale_).masked_fill(torch.arange(length) > pos[..., None], float("-inf"))
    scores = scores.view(s, hkv, r, nb, kt)
    m = scores.amax(-1).cummax(-1).values
    p = torch.exp(scores - m[..., None])
    pv = p.transpose(2, 3) @ v.float().reshape(s, hkv, nb, kt, d)
    # the recomputation is faithful: it reproduces the routine's output
    rowsum = p.sum(-1)
    l_acc, acc = rowsum[..., 0], pv[:, :, 0]
    if nb > 1:
        alpha = torch.exp(m[..., :-1] - m[..., 1:])
        for j in range(1, nb):
            l_acc = l_acc * alpha[..., j - 1] + rowsum[..., j]
            acc = acc * alpha[..., j - 1][..., None] + pv[:, :, j]
    assert torch.equal((acc / l_acc[..., None]).to(q.dtype), original(qd, k, v, pos, scale_, kt).to(q.dtype))
    return out, Captured(qd.float(), raw, p, pv)


class TorchHooks:
    """Supplies the hardware primitives from torch; records any input the replay hands a GEMM
    that differs from the reference's GEMM input."""

    def __init__(self, cap: Captured, block_rows: int, kv_tile: int, head_dim: int) -> None:
        self.cap, self.br, self.kt, self.d = cap, block_rows, kv_tile, head_dim
        self.mismatches: list[str] = []
        self.calls = 0
        self._keep = (QK_FN(self._qk), PV_FN(self._pv), EXP_FN(self._exp), ROWSUM_FN(self._rowsum))
        self.struct = Hooks(None, *self._keep)

    def _rows(self, task) -> tuple[int, int]:
        r_ref = self.cap.qd.shape[2]
        lo = task.first_row
        return lo, min(lo + self.br, r_ref)

    def _qk(self, _ctx, task_p, tile, _kv_row, q_block, out):
        self.calls += 1
        task = task_p.contents
        lo, hi = self._rows(task)
        mine = as_tensor(q_block, self.br * self.d).view(self.br, self.d)
        ref_q = self.cap.qd[task.seq, task.kv_head, lo:hi]
        if not torch.equal(mine[:task.valid_rows], ref_q[:task.valid_rows]):
            self.mismatches.append(f"Q block seq {task.seq} head {task.kv_head} block {task.block}")
        dst = as_tensor(out, self.br * self.kt).view(self.br, self.kt)
        dst.zero_()
        dst[:hi - lo] = self.cap.raw[task.seq, task.kv_head, lo:hi, tile * self.kt:(tile + 1) * self.kt]

    def _pv(self, _ctx, task_p, tile, _kv_row, p, out):
        self.calls += 1
        task = task_p.contents
        lo, hi = self._rows(task)
        mine = as_tensor(p, self.br * self.kt).view(self.br, self.kt)
        ref_p = self.cap.p[task.seq, task.kv_head, lo:hi, tile]
        if not torch.equal(mine[:task.valid_rows], ref_p[:task.valid_rows]):
            self.mismatches.append(f"P tile seq {task.seq} head {task.kv_head} block {task.block} tile {tile}")
        dst = as_tensor(out, self.br * self.d).view(self.br, self.d)
        dst.zero_()
        dst[:hi - lo] = self.cap.pv[task.seq, task.kv_head, tile, lo:hi]

    def _exp(self, _ctx, x, n):
        self.calls += 1
        as_tensor(x, n).exp_()

    def _rowsum(self, _ctx, p, rows, cols, out):
        self.calls += 1
        as_tensor(out, rows).copy_(as_tensor(p, rows * cols).view(rows, cols).sum(-1))


SHAPES = [  # (kv_tile, num_kv_heads, group, head_dim)
    (16, 2, 1, 16), (16, 2, 2, 16), (16, 1, 4, 32), (64, 2, 2, 16), (32, 2, 4, 16),
]


def make_inputs(kv_tile: int, hkv: int, group: int, d: int, dtype: torch.dtype, seed: int):
    gen = torch.Generator().manual_seed(seed)
    lens = [1, kv_tile - 1, kv_tile, kv_tile + 1, 2 * kv_tile + 3, 5]
    n = sum(lens)
    q = torch.randn(n, hkv * group, d, generator=gen).to(dtype)
    k = torch.randn(n, hkv, d, generator=gen).to(dtype)
    v = torch.randn(n, hkv, d, generator=gen).to(dtype)
    return gen, lens, q, k, v


def oracle_replay(native: NativeLib, plan: Plan, q, k_rows, v_rows, kv, batch, scale, kv_tile, row_tile=8):
    """Replay ``plan`` with torch primitives; returns (replay output in q's dtype, reference output)."""
    ref_out, cap = reference_with_intermediates(q, kv, batch, scale, row_tile, kv_tile)
    g = plan.geometry
    hooks = TorchHooks(cap, g.block_rows, g.kv_tile, g.head_dim)
    out = native.replay(plan, q, k_rows, v_rows, hooks.struct)
    assert hooks.calls > 0
    assert not hooks.mismatches, hooks.mismatches[:5]
    return out.to(q.dtype), ref_out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"kv{s[0]}-hkv{s[1]}-g{s[2]}-d{s[3]}")
def test_oracle_replay_equals_reference_in_every_view(native: NativeLib, shape, dtype) -> None:
    kv_tile, hkv, group, d = shape
    gen, lens, q, k, v = make_inputs(kv_tile, hkv, group, d, dtype, seed=kv_tile + 7 * group)
    scale = d ** -0.5
    cst = native.consts(num_heads=hkv * group, num_kv_heads=hkv, head_dim=d, kv_tile=kv_tile,
                        dtype_bytes=2 if dtype != torch.float32 else 4, scale=scale)
    cu = torch.tensor([0, *np.cumsum(lens).tolist()])

    # training forward: packed sequences, contiguous K/V
    batch = AttentionBatch.build(lens, [0] * len(lens), lens)
    got, want = oracle_replay(native, native.plan_training(cst, lens), q, k, v, ContiguousKV(k, v, cu), batch,
                              scale, kv_tile)
    assert torch.equal(got, want), "training view"
    train_ref = want

    # paged cache (page = 2 tiles), shuffled pages
    page = 2 * kv_tile
    kp, vp, table = paged_cache(k, v, lens, page, gen)
    k_flat, v_flat = kp.reshape(-1, hkv, d), vp.reshape(-1, hkv, d)
    table32 = table.numpy().astype(np.int32)

    # chunked prefill of every sequence over the cache, one call
    for chunk in (1, kv_tile + 2):
        starts = [min(n - 1, chunk) for n in lens]
        q_lens = [n - s for n, s in zip(lens, starts, strict=True)]
        idx = torch.cat([torch.arange(int(cu[i]) + s, int(cu[i + 1])) for i, s in enumerate(starts)])
        batch = AttentionBatch.build(q_lens, starts, lens)
        plan = native.plan_paged(cst, q_lens, starts, lens, table32, page)
        got, want = oracle_replay(native, plan, q[idx], k_flat, v_flat, PagedKV(kp, vp, table), batch, scale, kv_tile)
        assert torch.equal(got, want), f"chunked prefill from {chunk}"
        assert torch.equal(got, train_ref[idx]), f"chunked prefill from {chunk} vs training"

    # paged decode: one position of every sequence per call, mixed batch
    for t in sorted({0, kv_tile - 1, kv_tile, kv_tile + 1, 2 * kv_tile + 2}):
        seqs = [s for s, n in enumerate(lens) if n > t]
        idx = torch.tensor([int(cu[s]) + t for s in seqs])
        batch = AttentionBatch.build([1] * len(seqs), [t] * len(seqs), [t + 1] * len(seqs))
        plan = native.plan_paged(cst, [1] * len(seqs), [t] * len(seqs), [t + 1] * len(seqs), table32[seqs], page,
                                 workers=5)
        got, want = oracle_replay(native, plan, q[idx], k_flat, v_flat, PagedKV(kp, vp, table[seqs]), batch,
                                  scale, kv_tile)
        assert torch.equal(got, want), f"decode step {t}"
        assert torch.equal(got, train_ref[idx]), f"decode step {t} vs training"


def test_oracle_replay_with_larger_blocks_still_equals_reference(native: NativeLib) -> None:
    """Blocks of 4 row tiles (32 rows): rows are independent, so the bits do not change."""
    kv_tile, hkv, group, d = 16, 2, 2, 16
    _, lens, q, k, v = make_inputs(kv_tile, hkv, group, d, torch.float32, seed=3)
    cu = torch.tensor([0, *np.cumsum(lens).tolist()])
    scale = 0.25
    cst = native.consts(num_heads=hkv * group, num_kv_heads=hkv, head_dim=d, kv_tile=kv_tile, row_tiles_per_block=4,
                        scale=scale)
    batch = AttentionBatch.build(lens, [0] * len(lens), lens)
    got, want = oracle_replay(native, native.plan_training(cst, lens, workers=3), q, k, v, ContiguousKV(k, v, cu),
                              batch, scale, kv_tile)
    assert torch.equal(got, want)


@pytest.mark.parametrize("shape", SHAPES[:4], ids=lambda s: f"kv{s[0]}-hkv{s[1]}-g{s[2]}-d{s[3]}")
def test_native_replay_gives_identical_bits_in_every_view(native: NativeLib, shape) -> None:
    kv_tile, hkv, group, d = shape
    gen, lens, q, k, v = make_inputs(kv_tile, hkv, group, d, torch.float32, seed=11)
    scale = d ** -0.5
    cst = native.consts(num_heads=hkv * group, num_kv_heads=hkv, head_dim=d, kv_tile=kv_tile, scale=scale)
    cu = np.concatenate([[0], np.cumsum(lens)])
    train = native.replay(native.plan_training(cst, lens), q, k, v)
    assert torch.isfinite(train).all()
    # close to the reference (different primitives: expf, fixed-order dots, tree row sums)
    batch = AttentionBatch.build(lens, [0] * len(lens), lens)
    ref = get_backend(KernelConfig(kv_tile=kv_tile)).attention(q, ContiguousKV(k, v, torch.tensor(cu)), batch, scale)
    torch.testing.assert_close(train, ref, rtol=1e-5, atol=1e-5)

    page = kv_tile
    kp, vp, table = paged_cache(k, v, lens, page, gen)
    k_flat, v_flat = kp.reshape(-1, hkv, d), vp.reshape(-1, hkv, d)
    table32 = table.numpy().astype(np.int32)
    # each sequence alone, with a different block size and worker count
    alone_cst = native.consts(num_heads=hkv * group, num_kv_heads=hkv, head_dim=d, kv_tile=kv_tile,
                              row_tiles_per_block=2, scale=scale)
    for s, n in enumerate(lens):
        one = native.replay(native.plan_training(alone_cst, [n], workers=1), q[cu[s]:cu[s + 1]],
                            k[cu[s]:cu[s + 1]], v[cu[s]:cu[s + 1]])
        assert torch.equal(one, train[cu[s]:cu[s + 1]]), f"prefill alone seq {s}"
    # chunked prefill over the paged cache
    for chunk in (2, kv_tile + 1):
        starts = [min(n - 1, chunk) for n in lens]
        q_lens = [n - st for n, st in zip(lens, starts, strict=True)]
        idx = torch.cat([torch.arange(cu[i] + st, cu[i + 1]) for i, st in enumerate(starts)])
        got = native.replay(native.plan_paged(cst, q_lens, starts, lens, table32, page), q[idx], k_flat, v_flat)
        assert torch.equal(got, train[idx]), f"chunked prefill from {chunk}"
    # paged decode of every position
    for t in range(max(lens)):
        seqs = [s for s, n in enumerate(lens) if n > t]
        idx = torch.tensor([int(cu[s]) + t for s in seqs])
        plan = native.plan_paged(cst, [1] * len(seqs), [t] * len(seqs), [t + 1] * len(seqs), table32[seqs], page,
                                 workers=2)
        got = native.replay(plan, q[idx], k_flat, v_flat)
        assert torch.equal(got, train[idx]), f"decode step {t}"


def test_native_row_sum_is_the_documented_fold_and_tree(native: NativeLib) -> None:
    x = torch.randn(256, generator=torch.Generator().manual_seed(0))
    lanes = x.view(4, 64)
    acc = lanes[0].clone()
    for i in range(1, 4):
        acc = acc + lanes[i]
    while acc.numel() > 1:
        acc = acc[0::2] + acc[1::2]
    got = native.dll.op_rp_native_rowsum(ctypes.cast(x.data_ptr(), ctypes.POINTER(ctypes.c_float)), 256)
    assert np.float32(got) == acc.item()
