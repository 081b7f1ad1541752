"""rowdot, the consistent linear (kernels/cpu): its bits depend only on the inputs, never on the
rows or columns a call computes, its micro-tiles, threads or instruction set; its gradient is the
plain GEMMs' one; the build is cached and atomic; bad input is a clear error."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor

from onpolicy.kernels import cpu

SHAPES = [(1, 1, 1), (1, 7, 5), (2, 12, 8), (3, 33, 64), (4, 3, 9), (5, 96, 97), (9, 193, 576), (67, 40, 129)]
DTYPES = [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16), (torch.float32, torch.bfloat16)]


def operands(m: int, n: int, k: int, xd: torch.dtype, wd: torch.dtype, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(m, k, generator=gen).to(xd), torch.randn(n, k, generator=gen).to(wd)


@pytest.mark.parametrize("m,n,k", SHAPES)
@pytest.mark.parametrize("xd,wd", DTYPES)
def test_bits_do_not_depend_on_rows_columns_threads_or_path(m, n, k, xd, wd) -> None:
    x, w = operands(m, n, k, xd, wd, m * 1000 + n + k)
    y = cpu.rowdot(x, w)
    assert y.dtype == torch.float32 and y.shape == (m, n)
    assert torch.equal(y, cpu.rowdot(x, w, portable=True))
    assert torch.equal(y, cpu.rowdot(x, w, threads=1))
    assert torch.equal(y, cpu.rowdot(x, w, threads=3))
    assert torch.equal(y, torch.cat([cpu.rowdot(x[i:i + 1], w) for i in range(m)]))
    assert torch.equal(y, torch.cat([cpu.rowdot(x, w[a:a + 5]) for a in range(0, n, 5)], 1))
    # the row inside a bigger batch of other rows (a decode row among a training batch)
    others = torch.cat([torch.randn(70, k).to(xd), x, torch.randn(3, k).to(xd)])
    assert torch.equal(cpu.rowdot(others, w)[70:70 + m], y)
    ref = x.double() @ w.double().T
    assert torch.allclose(y.double(), ref, rtol=1e-5, atol=1e-4 * k ** 0.5)


def test_a_column_slice_of_x_is_read_in_place() -> None:
    x, w = operands(6, 20, 128, torch.float32, torch.float32, 3)
    part = x[:, 32:96]
    assert part.stride() == (128, 1)
    assert torch.equal(cpu.rowdot(part, w[:, 32:96]), cpu.rowdot(part.contiguous(), w[:, 32:96].contiguous()))
    # a transposed operand is copied first, with the same bits
    assert torch.equal(cpu.rowdot(x.t().contiguous().t(), w), cpu.rowdot(x, w))


def test_the_sum_order_is_the_documented_one() -> None:
    """Eight lanes over K in blocks of 8, fused multiply-adds, then ((a0+a4)+(a2+a6))+((a1+a5)+(a3+a7))."""
    gen = torch.Generator().manual_seed(5)
    x, w = torch.randn(1, 21, generator=gen), torch.randn(1, 21, generator=gen)
    xs, ws = x[0].double().tolist() + [0.0] * 3, w[0].double().tolist() + [0.0] * 3
    lanes = [0.0] * 8
    for k in range(0, 24, 8):
        for j in range(8):  # fma: the exact product plus the lane, rounded once to fp32
            lanes[j] = float(torch.tensor(xs[k + j] * ws[k + j] + lanes[j], dtype=torch.float64).float())
    f = [torch.tensor(v, dtype=torch.float32) for v in lanes]
    want = ((f[0] + f[4]) + (f[2] + f[6])) + ((f[1] + f[5]) + (f[3] + f[7]))
    assert torch.equal(cpu.rowdot(x, w)[0, 0], want)


def test_it_differs_from_the_fast_gemm_somewhere() -> None:
    """Not MKL in disguise: over many rows some element differs from F.linear's bits."""
    x, w = operands(64, 256, 576, torch.float32, torch.float32, 9)
    assert not torch.equal(cpu.rowdot(x, w), F.linear(x, w))


@pytest.mark.parametrize("xd,wd", DTYPES)
def test_gradients_are_the_plain_gemms(xd, wd) -> None:
    x, w = operands(13, 24, 40, xd, wd, 11)
    x.requires_grad_()
    w.requires_grad_()
    y = cpu.linear(x, w)
    assert y.dtype == xd and torch.equal(y.detach(), cpu.rowdot(x.detach(), w.detach()).to(xd))
    g = torch.randn(13, 24).to(xd)
    y.backward(g)
    # fp32 GEMMs of the (exactly) widened operands, rounded once to each operand's dtype
    assert torch.equal(x.grad, g.float().mm(w.detach().float()).to(xd))
    assert torch.equal(w.grad, g.float().t().mm(x.detach().float()).to(wd))


@pytest.mark.parametrize("bad,match", [
    (lambda: cpu.rowdot(torch.randn(3), torch.randn(2, 3)), "2-D x"),
    (lambda: cpu.rowdot(torch.randn(2, 3), torch.randn(2, 4)), "3 columns, weight has 4"),
    (lambda: cpu.rowdot(torch.ones(2, 3, dtype=torch.int32), torch.randn(2, 3)), "fp32, bf16 and fp16 x"),
    (lambda: cpu.rowdot(torch.randn(2, 3), torch.randn(2, 3, dtype=torch.float64)), "fp32, bf16 and fp16 weight"),
    (lambda: cpu.rowdot_chunks(torch.randn(2, 12), torch.randn(4, 5, 4), fold=True), "4 chunks of 4 need 16"),
    (lambda: cpu.linear(torch.randn(3), torch.randn(2, 3)), "linear expects x"),
    (lambda: cpu.linear(torch.randn(2, 3), torch.randn(2, 4)), "linear expects x"),
])
def test_bad_operands_are_clear_errors(bad, match) -> None:
    with pytest.raises(ValueError, match=match):
        bad()


def test_fp16_operands_are_widened_exactly() -> None:
    x, w = operands(5, 9, 33, torch.float16, torch.float16, 4)
    assert torch.equal(cpu.rowdot(x, w), cpu.rowdot(x.float(), w.float()))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("m,n,kc,c", [(1, 7, 5, 4), (6, 33, 16, 2), (13, 20, 40, 4), (1, 96, 144, 1)])
def test_chunked_form_is_the_per_chunk_calls_and_the_fold(dtype, m, n, kc, c) -> None:
    from onpolicy.kernels.backend import chunk_major, fold_chunks

    x, w = operands(m, n, c * kc, dtype, dtype, m + n + kc + c)
    chunks = chunk_major(w, c)
    per = torch.stack([cpu.linear(x[:, i * kc:(i + 1) * kc].contiguous(), chunks[i]) for i in range(c)])
    parts = cpu.chunked_linear(x, chunks, fold=False)
    assert parts.dtype == dtype and torch.equal(parts, per)
    folded = cpu.chunked_linear(x, chunks, fold=True)
    assert folded.dtype == dtype and torch.equal(folded, fold_chunks(per).to(dtype))
    rb = dtype == torch.bfloat16
    assert torch.equal(cpu.rowdot_chunks(x, chunks, fold=True, round_bf16=rb),
                       cpu.rowdot_chunks(x, chunks, fold=True, round_bf16=rb, portable=True))
    assert torch.equal(cpu.rowdot_chunks(x, chunks, fold=False, round_bf16=rb, threads=1),
                       cpu.rowdot_chunks(x, chunks, fold=False, round_bf16=rb, threads=2))


def test_bf16_partials_round_like_torch_including_halfway_cases() -> None:
    """Partials exactly halfway between two bf16 values round to even, as ``Tensor.to(bfloat16)``."""
    halfway = torch.tensor([1 + 2 ** -8, 1 + 3 * 2 ** -8, -(1 + 2 ** -8), 3.0, float("inf")])
    x = torch.ones(len(halfway), 1)
    w = halfway[:, None]  # y[i, j] = halfway[j]
    parts = cpu.rowdot_chunks(x, w[None], fold=False, round_bf16=True)
    assert torch.equal(parts[0], halfway.to(torch.bfloat16).float().expand(len(halfway), -1))


@pytest.mark.parametrize("fold", [True, False])
def test_chunked_gradients_are_the_linear_gemms(fold) -> None:
    from onpolicy.kernels.backend import chunk_major

    x, w = operands(9, 12, 32, torch.float32, torch.float32, 21)
    chunks = chunk_major(w, 4).requires_grad_()
    x.requires_grad_()
    y = cpu.chunked_linear(x, chunks, fold=fold)
    g = torch.randn(y.shape)
    y.backward(g)
    if fold:  # one GEMM per operand over the whole K
        assert torch.equal(x.grad, g.mm(w))
        assert torch.equal(chunks.grad, chunk_major(g.t().mm(x.detach()), 4))
        return
    grads = list(g)
    assert torch.equal(x.grad, torch.cat([gi.mm(chunks[i].detach()) for i, gi in enumerate(grads)], 1))
    assert torch.equal(chunks.grad, torch.stack([gi.t().mm(x.detach()[:, i * 8:(i + 1) * 8])
                                                 for i, gi in enumerate(grads)]))


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_reference_row_linear_in_one_call_equals_the_generic_reduction(dtype) -> None:
    from onpolicy.kernels import KernelConfig, get_backend
    from onpolicy.kernels.backend import Backend, chunk_major

    class Chunked:
        def __init__(self, w: torch.Tensor) -> None:
            self.weight = w

        def chunked(self, chunks: int) -> torch.Tensor:
            return chunk_major(self.weight, chunks)

    ops = get_backend(KernelConfig(compute_dtype=dtype))
    x, w = operands(11, 64, 128, ops.config.dtype, ops.config.dtype, 8)
    generic = Backend.row_linear(ops, x, Chunked(w))  # per-rank partials, gather, fold_chunks
    assert torch.equal(ops.row_linear(x, Chunked(w)), generic)


def test_empty_operands() -> None:
    assert cpu.rowdot(torch.randn(0, 8), torch.randn(5, 8)).shape == (0, 5)
    assert torch.equal(cpu.rowdot(torch.randn(2, 0), torch.randn(5, 0)), torch.zeros(2, 5))


def test_build_is_cached_per_source_and_compiler_and_a_missing_compiler_is_named(tmp_path) -> None:
    env = dict(os.environ, ONPOLICY_HOME=str(tmp_path))
    code = ("from onpolicy.kernels import cpu; p = cpu.build(); "
            "print(p); print(p.stat().st_mtime_ns)")
    first = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    again = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert first.stdout == again.stdout  # the second process reused the first one's library
    lib = tmp_path / "native"
    assert [p.name for p in lib.iterdir()] == [first.stdout.split()[0].rsplit("/", 1)[1]]  # no temporaries left
    assert (next(lib.iterdir()).stat().st_mode & 0o777) == 0o755  # loadable by other users of the home
    missing = subprocess.run([sys.executable, "-c", code], env=dict(env, CC="no-such-cc"),
                             capture_output=True, text=True)
    assert missing.returncode != 0
    assert "NativeBuildError" in missing.stderr and "'no-such-cc' was not found" in missing.stderr


@pytest.mark.parametrize("m", [0, 1, 3, 9, 70])
@pytest.mark.parametrize("xd,wd", DTYPES)
def test_a_group_call_gives_each_weight_the_bits_of_its_own_call(m, xd, wd) -> None:
    gen = torch.Generator().manual_seed(m)
    x = torch.randn(m, 100, generator=gen).to(xd)
    weights = [torch.randn(n, 100, generator=gen).to(wd) for n in (5, 96, 200, 0, 1, 8, 17)]
    for threads in (1, 2, 3):
        ys = cpu.rowdot_group(x, weights, threads=threads)
        assert [y.shape for y in ys] == [(m, w.shape[0]) for w in weights]
        for y, w in zip(ys, weights, strict=True):
            assert torch.equal(y, cpu.rowdot(x, w, threads=1))
        for a, b in zip(ys, cpu.rowdot_group(x, weights, threads=threads, portable=True), strict=True):
            assert torch.equal(a, b)
    # a weight may be a row slice of a wider tensor (read in place)
    wide = torch.randn(12, 300, generator=gen).to(wd)
    assert torch.equal(cpu.rowdot_group(x, [wide[:, 100:200]])[0], cpu.rowdot(x, wide[:, 100:200].contiguous()))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("need", ["all", "x", "weights"])
def test_linears_keeps_each_linear_and_its_gradient(dtype, need) -> None:
    """Under autograd too, the group is one call whose outputs have each linear's bits; its
    gradients are the separate linears' (x's accumulated in fp32 in one buffer)."""
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(37, 64, generator=gen).to(dtype)
    ws = [(torch.randn(n, 64, generator=gen) * 0.1).to(dtype) for n in (64, 16, 24)]
    ups = [torch.randn(37, n, generator=gen).to(dtype) for n in (64, 16, 24)]
    for y, w in zip(cpu.linears(x, ws), ws, strict=True):
        assert y.dtype == dtype and torch.equal(y, cpu.linear(x, w))

    def run(group: bool) -> tuple[Tensor | None, list[Tensor | None]]:
        xg = x.clone().requires_grad_(need in ("all", "x"))
        wg = [w.clone().requires_grad_(need in ("all", "weights")) for w in ws]
        ys = cpu.linears(xg, wg) if group else [cpu.linear(xg, w) for w in wg]
        for y, w in zip(ys, ws, strict=True):
            assert y.requires_grad and torch.equal(y.detach(), cpu.linear(x, w))
        sum((y.float() * u.float()).sum() for y, u in zip(ys, ups, strict=True)).backward()
        return xg.grad, [w.grad for w in wg]

    (gx, gws), (rx, rws) = run(True), run(False)
    assert (gx is None) == (need == "weights") and all((g is None) == (need == "x") for g in gws)
    if gx is not None:  # fp32 GEMMs accumulated in one buffer, rounded once
        want = ups[0].float().mm(ws[0].float())
        for u, w in zip(ups[1:], ws[1:], strict=True):
            want.addmm_(u.float(), w.float())
        assert torch.equal(gx, want.to(dtype))
        assert torch.allclose(gx.float(), rx.float(), rtol=2e-2, atol=2e-2)  # the separate linears' sum
    for g, r in zip(gws, rws, strict=True):
        assert g is None or torch.equal(g, r)  # each weight's own GEMM


def test_an_unused_output_of_a_group_leaves_its_weight_without_a_gradient() -> None:
    """As separate linears would: None, not zeros (optimizers treat the two differently)."""
    gen = torch.Generator().manual_seed(6)
    x = torch.randn(5, 16, generator=gen).requires_grad_()
    ws = [torch.randn(n, 16, generator=gen).requires_grad_() for n in (8, 4, 8)]
    q, _, v = cpu.linears(x, ws)
    (q.sum() + v.sum()).backward()
    assert ws[1].grad is None and ws[0].grad is not None and ws[2].grad is not None
    assert torch.allclose(x.grad, (ws[0].sum(0) + ws[2].sum(0)).detach().expand(5, 16), rtol=1e-5, atol=1e-5)
    (k,) = cpu.linears(x, ws[1:2])
    k.sum().backward()  # a group of one
    assert torch.allclose(ws[1].grad, x.detach().sum(0).expand(4, 16), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("weights,match", [
    ([torch.randn(3, 7)], "need 8 columns"),
    ([torch.randn(3, 8), torch.randn(3, 8).bfloat16()], "one dtype"),
    ([torch.randn(1, 8)] * (cpu.GROUP_MAX + 1), "1 to 8 weights"),
    ([], "1 to 8 weights"),
])
def test_bad_groups_are_clear_errors(weights, match) -> None:
    with pytest.raises(ValueError, match=match):
        cpu.rowdot_group(torch.randn(2, 8), weights)
