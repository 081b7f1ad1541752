"""RMSNorm and SwiGLU under autograd: the forward runs the no-grad steps (bitwise the same output),
the backward is an analytic gradient that matches autograd through the plain ops to rounding."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from onpolicy.kernels.spec import elementwise as E

TOL = {torch.float32: dict(rtol=1e-4, atol=1e-5), torch.bfloat16: dict(rtol=2e-2, atol=2e-2)}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rmsnorm_autograd(dtype) -> None:
    gen = torch.Generator().manual_seed(1)
    x = (torch.randn(3, 11, 64, generator=gen) * 3).to(dtype).requires_grad_()
    w = (torch.randn(64, generator=gen) + 1).to(dtype).requires_grad_()
    y = E.rmsnorm(x, w, 1e-6)
    with torch.no_grad():
        assert torch.equal(y.detach(), E.rmsnorm(x, w, 1e-6))
    g = torch.randn(y.shape, generator=gen).to(dtype)
    gx, gw = torch.autograd.grad(y, (x, w), g)
    xf = x.float()
    plain = w.float() * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6))
    px, pw = torch.autograd.grad(plain, (x, w), g.float())
    assert gx.dtype == dtype and gw.dtype == dtype
    torch.testing.assert_close(gx.float(), px.float(), **TOL[dtype])
    torch.testing.assert_close(gw.float(), pw.float(), rtol=TOL[dtype]["rtol"], atol=TOL[dtype]["atol"] * 50)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_swiglu_autograd(dtype) -> None:
    gen = torch.Generator().manual_seed(2)
    gate = (torch.randn(17, 96, generator=gen) * 4).to(dtype).requires_grad_()
    up = torch.randn(17, 96, generator=gen).to(dtype).requires_grad_()
    y = E.swiglu(gate, up)
    with torch.no_grad():
        assert torch.equal(y.detach(), E.swiglu(gate, up))
    g = torch.randn(y.shape, generator=gen).to(dtype)
    gg, gu = torch.autograd.grad(y, (gate, up), g)
    pg, pu = torch.autograd.grad(F.silu(gate.float()) * up.float(), (gate, up), g.float())
    torch.testing.assert_close(gg.float(), pg.float(), **TOL[dtype])
    torch.testing.assert_close(gu.float(), pu.float(), **TOL[dtype])
