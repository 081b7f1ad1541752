"""RMSNorm, RoPE and SwiGLU in C (kernels/cpu/rowwise.c): vector and portable paths and thread
counts give the same bits, a row alone equals the row in a batch, RoPE is bitwise the torch
expression, RMSNorm sums the squares in rowdot's order, both stay within rounding of torch; under
autograd the reference backend's forward is the no-grad bits and the gradient is the analytic one."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from onpolicy.kernels import KernelConfig, cpu, get_backend
from onpolicy.kernels.cpu import rowwise
from onpolicy.kernels.spec import elementwise as E

DTYPES = [torch.float32, torch.bfloat16]


def rnd(*shape: int, seed: int, scale: float = 1.0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale


@pytest.mark.parametrize("xd", DTYPES)
@pytest.mark.parametrize("wd", DTYPES)
@pytest.mark.parametrize("h", [1, 13, 64, 576])
def test_rmsnorm_paths_rows_and_accuracy(xd, wd, h) -> None:
    x, w = rnd(70, h, seed=h, scale=3).to(xd), (rnd(h, seed=h + 1) + 1).to(wd)
    y = rowwise.rmsnorm(x, w, 1e-6)
    assert y.dtype == (torch.bfloat16 if xd == wd == torch.bfloat16 else torch.float32)
    assert torch.equal(y, rowwise.rmsnorm(x, w, 1e-6, portable=True))
    assert torch.equal(y, rowwise.rmsnorm(x, w, 1e-6, threads=1))
    assert torch.equal(y, torch.cat([rowwise.rmsnorm(x[i:i + 1], w, 1e-6) for i in range(70)]))
    big = torch.cat([x] * 8)  # enough rows for the parallel region
    assert torch.equal(rowwise.rmsnorm(big, w, 1e-6)[:70], y)
    tol = 1e-5 if y.dtype == torch.float32 else 1e-2
    torch.testing.assert_close(y.float(), E.rmsnorm(x, w, 1e-6).float(), rtol=tol, atol=tol)


def test_rmsnorm_sums_squares_in_rowdot_order() -> None:
    x, w = rnd(3, 21, seed=3), torch.ones(21)
    ss = cpu.rowdot(x, x)[range(3), range(3)]  # dot(x, x) in rowdot's documented order
    r = 1.0 / torch.sqrt(ss / torch.tensor(21.0) + torch.tensor(1e-6, dtype=torch.float32))
    assert torch.equal(rowwise.rmsnorm(x, w, 1e-6), x * r[:, None])


@pytest.mark.parametrize("dtype", DTYPES)
def test_rope_is_the_torch_expression(dtype) -> None:
    x, cos, sin = rnd(11, 5, 64, seed=4, scale=2).to(dtype), rnd(11, 64, seed=5), rnd(11, 64, seed=6)
    assert torch.equal(rowwise.rope(x, cos, sin), E.rope(x, cos, sin))
    view = x[:, 1:4]  # a head slice, read in place
    assert torch.equal(rowwise.rope(view, cos, sin), E.rope(view, cos, sin))
    big = torch.cat([x] * 40)
    assert torch.equal(rowwise.rope(big, torch.cat([cos] * 40), torch.cat([sin] * 40))[:11], E.rope(x, cos, sin))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("width", [7, 96, 1536])
def test_swiglu_paths_slices_and_accuracy(dtype, width) -> None:
    gu = rnd(40, 2 * width, seed=width, scale=4).to(dtype)
    gate, up = gu[:, :width], gu[:, width:]  # column slices of one tensor, read in place
    y = rowwise.swiglu(gate, up)
    assert y.dtype == dtype
    assert torch.equal(y, rowwise.swiglu(gate, up, portable=True))
    assert torch.equal(y, rowwise.swiglu(gate.contiguous(), up.contiguous(), threads=1))
    assert torch.equal(y, torch.cat([rowwise.swiglu(gate[i:i + 1], up[i:i + 1]) for i in range(40)]))
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(y.float(), (F.silu(gate.float()) * up.float()), rtol=tol, atol=tol)


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_backend_autograd_forward_is_the_no_grad_bits(dtype) -> None:
    ops = get_backend(KernelConfig(compute_dtype=dtype))
    dt = torch.float32 if dtype == "fp32" else torch.bfloat16
    x, w = rnd(9, 64, seed=7, scale=3).to(dt).requires_grad_(), (rnd(64, seed=8) + 1).to(dt).requires_grad_()
    g, u = rnd(9, 96, seed=9, scale=4).to(dt).requires_grad_(), rnd(9, 96, seed=10).to(dt).requires_grad_()
    q, cos, sin = rnd(9, 3, 16, seed=11).to(dt).requires_grad_(), rnd(9, 16, seed=12), rnd(9, 16, seed=13)
    y_norm, y_mlp, y_rope = ops.rmsnorm(x, w, 1e-6), ops.swiglu(g, u), ops.rope(q, cos, sin)
    with torch.no_grad():
        assert torch.equal(y_norm.detach(), rowwise.rmsnorm(x, w, 1e-6))
        assert torch.equal(y_mlp.detach(), rowwise.swiglu(g, u))
        assert torch.equal(y_rope.detach(), ops.rope(q, cos, sin))
    gx, gw = torch.autograd.grad(y_norm.float().sum(), (x, w))
    xf = x.float()
    plain = w.float() * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6))
    px, pw = torch.autograd.grad(plain.sum(), (x, w))
    tol = 1e-4 if dt == torch.float32 else 5e-2
    torch.testing.assert_close(gx.float(), px.float(), rtol=tol, atol=tol)
    torch.testing.assert_close(gw.float(), pw.float(), rtol=tol, atol=tol * 20)
    gg, gu_ = torch.autograd.grad(y_mlp.float().sum(), (g, u))
    pg, pu = torch.autograd.grad((F.silu(g.float()) * u.float()).sum(), (g, u))
    torch.testing.assert_close(gg.float(), pg.float(), rtol=tol, atol=tol)
    torch.testing.assert_close(gu_.float(), pu.float(), rtol=tol, atol=tol)


def test_bad_shapes_are_errors() -> None:
    with pytest.raises(ValueError, match="weight"):
        rowwise.rmsnorm(torch.ones(2, 8), torch.ones(7), 1e-6)
    with pytest.raises(ValueError, match="even head dim"):
        rowwise.rope(torch.ones(2, 1, 7), torch.ones(2, 7), torch.ones(2, 7))
    with pytest.raises(ValueError, match="differ"):
        rowwise.swiglu(torch.ones(2, 8), torch.ones(2, 9))


@pytest.mark.parametrize("backend", ["reference", "fast"])
def test_logprobs_at_temperature_one_are_the_divided_logits(backend) -> None:
    """The division is skipped when every temperature is exactly 1: the bits of dividing by 1."""
    ops = get_backend(KernelConfig(backend=backend))
    h, w = rnd(5, 64, seed=14), rnd(300, 64, seed=15)
    ones = torch.ones(5)
    logits = cpu.linear(h, w) if backend == "reference" else F.linear(h, w)
    assert torch.equal(ops.logprobs(h, w, ones), torch.log_softmax(logits / ones[:, None], -1))
    t = torch.tensor([1.0, 0.7, 1.0, 2.0, 1.0])
    assert torch.equal(ops.logprobs(h, w, t), torch.log_softmax(logits / t[:, None], -1))


@pytest.mark.parametrize("dtype", DTYPES)
def test_swiglu_backward_kernel_matches_the_torch_gradient(dtype) -> None:
    gate, up = rnd(33, 203, seed=16, scale=4).to(dtype), rnd(33, 203, seed=17).to(dtype)
    grad = rnd(33, 203, seed=18).to(dtype)
    d_gate, d_up = rowwise.swiglu_backward(gate, up, grad)
    assert d_gate.dtype == dtype and d_up.dtype == dtype
    want = E._swiglu_backward(gate, up, grad)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(d_gate.float(), want[0].float(), rtol=tol, atol=tol)
    torch.testing.assert_close(d_up.float(), want[1].float(), rtol=tol, atol=tol)


def test_other_dtypes_are_errors_not_misreads() -> None:
    with pytest.raises(ValueError, match="fp32/bf16"):
        rowwise.rmsnorm(torch.ones(2, 8, dtype=torch.float16), torch.ones(8), 1e-6)
    with pytest.raises(ValueError, match="fp32/bf16"):
        rowwise.swiglu(torch.ones(2, 8, dtype=torch.float64), torch.ones(2, 8, dtype=torch.float64))
