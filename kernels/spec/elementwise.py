"""Row-wise operators whose arithmetic is a fixed sequence of IEEE-exact elementwise ops and
per-row reductions: RMSNorm, RoPE, SwiGLU.

torch's fused ``silu``/``sigmoid`` are NOT used: on CPU their vectorised body and scalar tail give
different bits (measured), so a row's result would depend on where it sits in the tensor.
``exp`` is used instead; the selftest certifies that its vector and scalar paths agree.

These torch forms are the Ascend backend's host-side reference and the fp16 path; the reference
backend passes its native kernels (``kernels.cpu.rowwise``) as the ``forward`` of RMSNorm and
SwiGLU for fp32/bf16, under the same autograd functions.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor


def _no_grad(*ts: Tensor) -> bool:
    """Whether autograd records nothing here: then the steps below may run in place on the fresh
    tensors they made (the same ops on the same values, fewer allocations)."""
    return not torch.is_grad_enabled() or not any(t.requires_grad for t in ts)


def _rmsnorm_forward(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    xf = x.float()
    variance = xf.pow(2).mean(-1, keepdim=True)
    y = (xf * variance.add_(eps).rsqrt_()).to(x.dtype)
    return y.mul_(weight) if y.dtype == weight.dtype else weight * y  # IEEE multiply commutes


class _RMSNorm(torch.autograd.Function):
    """Forward: ``forward`` (the no-grad steps, or a native kernel: the bits of the no-grad path);
    backward: the analytic gradient in fp32 (gradients carry no bitwise contract)."""

    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor, eps: float, forward: Callable[..., Tensor]) -> Tensor:  # type: ignore[override]
        ctx.save_for_backward(x, weight)
        ctx.eps = eps
        return forward(x, weight, eps)

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor | None, Tensor | None, None, None]:  # type: ignore[override]
        x, weight = ctx.saved_tensors
        xf = x.float()
        r = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + ctx.eps)
        n = xf * r
        gx = gw = None
        if ctx.needs_input_grad[1]:
            gw = (grad.float() * n.to(x.dtype).float()).reshape(-1, n.shape[-1]).sum(0).to(weight.dtype)
        if ctx.needs_input_grad[0]:
            gn = grad.float() * weight.float()
            gx = (r * (gn - n * (gn * n).mean(-1, keepdim=True))).to(x.dtype)
        return gx, gw, None, None


def rmsnorm(x: Tensor, weight: Tensor, eps: float, forward: Callable[..., Tensor] = _rmsnorm_forward) -> Tensor:
    """RMSNorm with HF's cast/multiply order; ``forward(x, weight, eps)`` computes it without autograd
    (default: the torch steps above), and the same function runs inside the autograd function."""
    if _no_grad(x, weight):
        return forward(x, weight, eps)
    return _RMSNorm.apply(x, weight, eps, forward)


def rotate_half(x: Tensor) -> Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    xf = x.float()
    c, s = cos[:, None, :], sin[:, None, :]
    return (xf * c + rotate_half(xf) * s).to(x.dtype)


def silu(x: Tensor) -> Tensor:
    """``x / (1 + exp(-x))`` in fp32 from exact elementwise ops."""
    xf = x.float()
    if _no_grad(x):
        d = torch.neg(xf).exp_().add_(1.0)
        return torch.div(xf, d, out=d)
    return xf / (torch.exp(-xf) + 1.0)


def _swiglu_forward(gate: Tensor, up: Tensor) -> Tensor:
    return silu(gate).mul_(up.float()).to(gate.dtype)


def _swiglu_backward(gate: Tensor, up: Tensor, grad: Tensor) -> tuple[Tensor, Tensor]:
    gf, g = gate.float(), grad.float()
    sig = torch.sigmoid(gf)
    return (g * up.float() * sig * (1.0 + gf * (1.0 - sig))).to(gate.dtype), (g * gf * sig).to(up.dtype)


class _SwiGLU(torch.autograd.Function):
    """Forward: ``forward`` (the no-grad steps, or a native kernel); backward: ``backward``, the
    analytic gradient (torch ops in fp32, or a native kernel)."""

    @staticmethod
    def forward(ctx, gate: Tensor, up: Tensor, forward: Callable[..., Tensor],  # type: ignore[override]
                backward: Callable[..., tuple[Tensor, Tensor]]) -> Tensor:
        ctx.save_for_backward(gate, up)
        ctx.grad_fn = backward
        return forward(gate, up)

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor | None, Tensor | None, None, None]:  # type: ignore[override]
        gate, up = ctx.saved_tensors
        g_gate, g_up = ctx.grad_fn(gate, up, grad)
        return (g_gate if ctx.needs_input_grad[0] else None, g_up if ctx.needs_input_grad[1] else None, None, None)


def swiglu(gate: Tensor, up: Tensor, forward: Callable[..., Tensor] = _swiglu_forward,
           backward: Callable[..., tuple[Tensor, Tensor]] = _swiglu_backward) -> Tensor:
    """``silu(gate) * up`` in ``gate``'s dtype; ``forward(gate, up)`` computes it without autograd,
    ``backward(gate, up, grad)`` its gradient."""
    if _no_grad(gate, up):
        return forward(gate, up)
    return _SwiGLU.apply(gate, up, forward, backward)
