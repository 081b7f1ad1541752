"""The native attention (kernels/cpu/attention.c): a row's bits depend only on its query, its own
sequence's K/V at positions <= its own and the KV tile — never on the other rows, the source (paged
cache or training forward), positions past its own, threads or the instruction set; the order is
the documented one; it is close to exact attention; its gradient is the softmax-attention one."""

from __future__ import annotations

import math

import pytest
import torch

from onpolicy.kernels import AttentionBatch, ContiguousKV, KernelConfig, PagedKV, get_backend
from onpolicy.kernels.cpu import attention as na
from onpolicy.models.context import PackedContext

F32_ULP = 2.0 ** -23


def _f32(v: float) -> float:
    return float(torch.tensor(v, dtype=torch.float64).float())


def test_exp_paths_agree_and_are_accurate() -> None:
    x = torch.cat([torch.linspace(-87.0, 0.0, 200_003), torch.linspace(-3, 3, 1001)])
    y = na.exp(x)
    assert torch.equal(y, na.exp(x, portable=True))
    ref = torch.exp(x.double())
    assert float(((y.double() - ref).abs() / ref).max()) < 2 * F32_ULP
    special = na.exp(torch.tensor([float("-inf"), -100.0, 0.0, float("nan")]))
    assert special[:3].tolist() == [0.0, 0.0, 1.0] and math.isnan(special[3])


def _packed(lens: list[int], hq: int, hkv: int, d: int, dtype: torch.dtype, seed: int):
    gen = torch.Generator().manual_seed(seed)
    n = sum(lens)
    q = torch.randn(n, hq, d, generator=gen).to(dtype)
    k = torch.randn(n, hkv, d, generator=gen).to(dtype)
    v = torch.randn(n, hkv, d, generator=gen).to(dtype)
    return q, k, v, PackedContext(lens)


def _exact(q, k, v, lens: list[int], scale: float) -> torch.Tensor:
    out, start, g = [], 0, q.shape[1] // k.shape[1]
    for n in lens:
        qs = q[start:start + n].double().transpose(0, 1)
        ks = k[start:start + n].double().repeat_interleave(g, 1).transpose(0, 1)
        vs = v[start:start + n].double().repeat_interleave(g, 1).transpose(0, 1)
        s = (qs @ ks.transpose(1, 2) * scale).masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), -math.inf)
        out.append((s.softmax(-1) @ vs).transpose(0, 1))
        start += n
    return torch.cat(out)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("d,tile", [(64, 64), (40, 16), (13, 4)])
def test_rows_paths_threads_and_exactness(dtype, d, tile) -> None:
    lens = [150, 77, 5, 1]
    q, k, v, ctx = _packed(lens, 6, 2, d, dtype, d + tile)
    out = na.attention(q, ctx.kv(0, k, v), ctx.batch, 0.125, kv_tile=tile)
    assert out.dtype == dtype and out.shape == q.shape
    seq, pos = ctx.batch.memo("native_rows", lambda: None)
    idx = next(val for key, val in ctx.batch._memo.items() if isinstance(key, tuple) and key[0] == "native_index")[1]
    kr, vr = k.reshape(-1, d), v.reshape(-1, d)
    full = na.attention_rows(q, kr, vr, idx, seq, pos, 0.125, tile)
    assert torch.equal(full, na.attention_rows(q, kr, vr, idx, seq, pos, 0.125, tile, portable=True))
    assert torch.equal(full, na.attention_rows(q, kr, vr, idx, seq, pos, 0.125, tile, threads=1))
    assert torch.equal(full, na.attention_rows(q, kr, vr, idx, seq, pos, 0.125, tile, threads=3))
    for n in (0, 63, 64, 149, 150, 226, 230, 232):  # each row alone, first/last of tiles and sequences
        assert torch.equal(na.attention_rows(q[n:n + 1], kr, vr, idx, seq[n:n + 1], pos[n:n + 1], 0.125, tile),
                           full[n:n + 1])
    err = (full.double() - _exact(q, k, v, lens, 0.125)).abs().max()
    assert err < (1e-5 if dtype == torch.float32 else 1e-4), err


def test_the_order_is_the_documented_one() -> None:
    """Tiles of 4 positions, D = 10 (a zero-padded lane block), GQA 2:1: recomputed step by step."""
    lens, tile, scale = [11], 4, 0.3
    q, k, v, ctx = _packed(lens, 2, 1, 10, torch.float32, 4)
    out = na.attention(q, ctx.kv(0, k, v), ctx.batch, scale, kv_tile=tile)

    def dot(a: list[float], b: list[float]) -> float:
        a, b = a + [0.0] * 6, b + [0.0] * 6
        lanes = [0.0] * 8
        for blk in range(0, 16, 8):
            for j in range(8):
                lanes[j] = _f32(a[blk + j] * b[blk + j] + lanes[j])
        f = [torch.tensor(x) for x in lanes]
        return float(((f[0] + f[4]) + (f[2] + f[6])) + ((f[1] + f[5]) + (f[3] + f[7])))

    def exp_(x: float) -> float:
        return float(na.exp(torch.tensor([x]))[0])

    t32 = lambda x: torch.tensor(x, dtype=torch.float32)  # noqa: E731
    for p in range(11):
        for h in range(2):
            qv, m, l_, acc = q[p, h].tolist(), 0.0, t32(0.0), [t32(0.0)] * 10
            for j0 in range(0, p + 1, tile):
                js = range(j0, min(j0 + tile, p + 1))
                s = [float(t32(dot(qv, k[j, 0].tolist())) * t32(scale)) for j in js]
                m_new = max(s) if j0 == 0 else max(m, max(s))
                e = [exp_(float(t32(x) - t32(m_new))) for x in s]
                lanes = [t32(0.0)] * 8
                for i, x in enumerate(e):
                    lanes[i % 8] = lanes[i % 8] + t32(x)
                f = lanes
                r = ((f[0] + f[4]) + (f[2] + f[6])) + ((f[1] + f[5]) + (f[3] + f[7]))
                pv = [0.0] * 10
                for i, j in enumerate(js):
                    pv = [_f32(e[i] * v[j, 0, c].item() + pv[c]) for c in range(10)]
                if j0 == 0:
                    l_, acc = r, [t32(x) for x in pv]
                else:
                    a = t32(exp_(float(t32(m) - t32(m_new))))
                    l_ = l_ * a + r
                    acc = [acc[c] * a + t32(pv[c]) for c in range(10)]
                m = m_new
            want = torch.stack([acc[c] / l_ for c in range(10)])
            assert torch.equal(out[p, h], want), (p, h)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_paged_decode_equals_the_training_forward(dtype) -> None:
    """The same sequences as packed training rows and as one paged decode row per position, through
    the reference backend: bitwise equal; slots past each position hold NaN and are never read."""
    ops = get_backend(KernelConfig(kv_tile=16, compute_dtype="fp32" if dtype == torch.float32 else "bf16"))
    lens, page = [37, 20], 16
    q, k, v, ctx = _packed(lens, 4, 2, 32, dtype, 8)
    train = ops.attention(q, ctx.kv(0, k, v), ctx.batch, 0.2)
    pages = 2 + sum(-(-n // page) for n in lens)
    kp = torch.full((pages, page, 2, 32), float("nan"), dtype=dtype)
    vp = torch.full((pages, page, 2, 32), float("nan"), dtype=dtype)
    table = torch.zeros(len(lens), 3, dtype=torch.int64)
    start, nxt = 0, 1  # page 0 stays NaN: unused table entries point at it
    for s, n in enumerate(lens):
        for j in range(-(-n // page)):
            table[s, j] = nxt
            rows = slice(start + j * page, start + min(n, (j + 1) * page))
            kp[nxt, :rows.stop - rows.start], vp[nxt, :rows.stop - rows.start] = k[rows], v[rows]
            nxt += 1
        start += n
    for step in range(max(lens)):
        live = [s for s, n in enumerate(lens) if step < n]
        rows = [sum(lens[:s]) + step for s in live]
        batch = AttentionBatch.build([1] * len(live), [step] * len(live), [step + 1] * len(live))
        kv = PagedKV(kp, vp, table[live])
        assert torch.equal(ops.attention(q[rows], kv, batch, 0.2), train[rows]), step


def test_gradients_match_exact_attention() -> None:
    lens = [23, 9]
    q, k, v, ctx = _packed(lens, 6, 3, 16, torch.float32, 5)
    q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
    out = na.attention(q, ctx.kv(0, k, v), ctx.batch, 0.25, kv_tile=8)
    g = torch.randn(out.shape, generator=torch.Generator().manual_seed(1))
    got = torch.autograd.grad(out, (q, k, v), g)
    qd, kd, vd = (t.detach().double().requires_grad_() for t in (q, k, v))
    want = torch.autograd.grad(_exact(qd, kd, vd, lens, 0.25), (qd, kd, vd), g.double())
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a.double(), b, rtol=1e-4, atol=1e-5)
    with torch.no_grad():
        assert torch.equal(out.detach(), na.attention(q, ctx.kv(0, k, v), ctx.batch, 0.25, kv_tile=8))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("d", [64, 24, 13])  # two-vector tiles; a one-vector tail; the portable task
def test_native_backward_matches_exact_attention_and_is_deterministic(dtype, d) -> None:
    lens, scale = [1, 40, 7], 0.3  # 40 rows: three query blocks of the vector task
    q, k, v, ctx = _packed(lens, 6, 2, d, dtype, 7)
    g = torch.randn(q.shape, generator=torch.Generator().manual_seed(2))
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out = na.attention(leaves[0], ctx.kv(0, leaves[1], leaves[2]), ctx.batch, scale, kv_tile=8)
    got = torch.autograd.grad(out, leaves, g.to(dtype))
    assert [t.dtype for t in got] == [dtype] * 3
    exact = [t.detach().double().requires_grad_() for t in (q, k, v)]
    want = torch.autograd.grad(_exact(*exact, lens, scale), exact, g.to(dtype).double())
    tol = dict(rtol=2e-2, atol=2e-2) if dtype == torch.bfloat16 else dict(rtol=1e-4, atol=1e-5)
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a.double(), b, **tol)
    # the kernel itself: the same bits whatever the thread count
    kv = ctx.kv(0, k, v)
    seq, pos = na._row_layout(ctx.batch)
    k_rows, v_rows = (t.reshape(-1, d) for t in kv.flat())
    idx = na._index(kv, ctx.batch, 2, k_rows.shape[0], seq, pos)
    fwd = na.attention_rows(q, k_rows, v_rows, idx, seq, pos, scale, 8, checked=True)
    runs = [na.attention_backward(q, k_rows, v_rows, idx, seq, pos, fwd, g, scale, threads=t) for t in (1, 2, 3)]
    for other in runs[1:]:
        assert all(torch.equal(a, b) for a, b in zip(runs[0], other, strict=True))


@pytest.mark.parametrize("d", [64, 13])
def test_backward_takes_a_sequences_rows_in_any_order(d) -> None:
    """Rows need not come in position order: a block mixes early and late rows, and each row still
    reaches only the positions it read (reversed and shuffled rows against the exact gradient)."""
    lens, scale = [37, 20], 0.25
    q, k, v, ctx = _packed(lens, 4, 2, d, torch.float32, 9)
    kv = ctx.kv(0, k, v)
    seq, pos = na._row_layout(ctx.batch)
    k_rows, v_rows = (t.reshape(-1, d) for t in kv.flat())
    idx = na._index(kv, ctx.batch, 2, k_rows.shape[0], seq, pos)
    out = na.attention_rows(q, k_rows, v_rows, idx, seq, pos, scale, 8, checked=True)
    grad = torch.randn(q.shape, generator=torch.Generator().manual_seed(3))
    exact = [t.detach().double().requires_grad_() for t in (q, k, v)]
    want = torch.autograd.grad(_exact(*exact, lens, scale), exact, grad.double())
    n = q.shape[0]
    for perm in (torch.arange(n - 1, -1, -1), torch.randperm(n, generator=torch.Generator().manual_seed(1))):
        dq, dk, dv = na.attention_backward(q[perm], k_rows, v_rows, idx, seq[perm].contiguous(),
                                           pos[perm].contiguous(), out[perm], grad[perm], scale)
        got_q = torch.empty_like(dq)
        got_q[perm] = dq
        for a, b in zip((got_q, dk.view(k.shape), dv.view(v.shape)), want, strict=True):
            torch.testing.assert_close(a.double(), b, rtol=1e-4, atol=1e-5)


def test_a_rows_non_finite_gradient_reaches_only_the_positions_it_read() -> None:
    q, k, v, ctx = _packed([6], 2, 1, 16, torch.float32, 3)
    kv = ctx.kv(0, k, v)
    seq, pos = na._row_layout(ctx.batch)
    k_rows, v_rows = (t.reshape(-1, 16) for t in kv.flat())
    idx = na._index(kv, ctx.batch, 1, k_rows.shape[0], seq, pos)
    out = na.attention_rows(q, k_rows, v_rows, idx, seq, pos, 0.25, 8, checked=True)
    grad = torch.randn(q.shape, generator=torch.Generator().manual_seed(4))
    grad[0] = math.inf  # row 0 reads position 0 only; rows 1..5 share its block in the kernel
    _, dk, dv = na.attention_backward(q, k_rows, v_rows, idx, seq, pos, out, grad, 0.25)
    assert not torch.isfinite(dv[0]).all() and torch.isfinite(dk[1:]).all() and torch.isfinite(dv[1:]).all()
    # a non-finite key or value at position 4 reaches no query row before it
    bad_k, bad_v = k_rows.clone(), v_rows.clone()
    bad_k[4], bad_v[4] = math.inf, math.nan
    dq, _, _ = na.attention_backward(q, bad_k, bad_v, idx, seq, pos, out, grad.clamp(-1, 1), 0.25)
    assert torch.isfinite(dq[:4]).all() and not torch.isfinite(dq[4:]).all()
    with pytest.raises(ValueError, match="int64 and contiguous"):
        na.attention_backward(q, k_rows, v_rows, idx.int(), seq, pos, out, grad, 0.25)


def test_a_source_naming_rows_outside_its_storage_is_an_error() -> None:
    q, _, _, _ = _packed([4], 2, 1, 8, torch.float32, 0)
    pages = torch.zeros(2, 4, 1, 8)
    batch = AttentionBatch.build([4], [0], [4])
    bad = PagedKV(pages, pages, torch.tensor([[5]]))  # page 5 of a 2-page pool
    with pytest.raises(ValueError, match="outside its 8 storage rows"):
        na.attention(q, bad, batch, 0.5, kv_tile=4)
    ok = ContiguousKV(pages[0], pages[0], torch.tensor([0, 4]))
    assert na.attention(q, ok, batch, 0.5, kv_tile=4).shape == q.shape


def test_inputs_that_do_not_fit_together_are_errors_not_reads() -> None:
    """The kernel follows seq/pos/idx into memory unchecked, so the wrapper checks them first."""
    q, k, v, ctx = _packed([6, 3], 2, 1, 8, torch.float32, 1)
    kv = ctx.kv(0, k, v)
    with pytest.raises(ValueError, match="10 query rows for a batch of 9"):
        na.attention(torch.cat([q, q[:1]]), kv, ctx.batch, 0.5, kv_tile=4)
    na.attention(q, kv, ctx.batch, 0.5, kv_tile=4)
    seq, pos = ctx.batch.memo("native_rows", lambda: None)
    idx = next(val for key, val in ctx.batch._memo.items() if isinstance(key, tuple) and key[0] == "native_index")[1]
    kr, vr = k.reshape(-1, 8), v.reshape(-1, 8)
    for bad_seq, bad_pos in ((seq + 1, pos), (seq, pos + 7), (seq, pos - 1)):
        with pytest.raises(ValueError, match="outside the index"):
            na.attention_rows(q, kr, vr, idx, bad_seq, bad_pos, 0.5, 4)
    with pytest.raises(ValueError, match="do not fit together"):
        na.attention_rows(q, kr, vr, idx, seq, pos, 0.5, 0)
    with pytest.raises(ValueError, match="do not fit together"):
        na.attention_rows(q, kr, vr[:-1], idx, seq, pos, 0.5, 4)
