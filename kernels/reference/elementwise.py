"""Row-wise operators whose arithmetic is a fixed sequence of IEEE-exact elementwise ops and
per-row reductions: RMSNorm, RoPE, SwiGLU.

torch's fused ``silu``/``sigmoid`` are NOT used: on CPU their vectorised body and scalar tail give
different bits (measured), so a row's result would depend on where it sits in the tensor.
``exp`` is used instead; the selftest certifies that its vector and scalar paths agree.
"""

from __future__ import annotations

import torch
from torch import Tensor


def _no_grad(*ts: Tensor) -> bool:
    """Whether autograd records nothing here: then the steps below may run in place on the fresh
    tensors they made (the same ops on the same values, fewer allocations)."""
    return not torch.is_grad_enabled() or not any(t.requires_grad for t in ts)


def rmsnorm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    xf = x.float()
    variance = xf.pow(2).mean(-1, keepdim=True)
    if _no_grad(x, weight):
        y = (xf * variance.add_(eps).rsqrt_()).to(x.dtype)
        return y.mul_(weight) if y.dtype == weight.dtype else weight * y  # IEEE multiply commutes
    return weight * (xf * torch.rsqrt(variance + eps)).to(x.dtype)


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


def swiglu(gate: Tensor, up: Tensor) -> Tensor:
    if _no_grad(gate, up):
        return silu(gate).mul_(up.float()).to(gate.dtype)
    return (silu(gate) * up.float()).to(gate.dtype)
