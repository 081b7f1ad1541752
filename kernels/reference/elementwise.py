"""Row-wise operators whose arithmetic is a fixed sequence of IEEE-exact elementwise ops and
per-row reductions: RMSNorm, RoPE, SwiGLU.

torch's fused ``silu``/``sigmoid`` are NOT used: on CPU their vectorised body and scalar tail give
different bits (measured), so a row's result would depend on where it sits in the tensor.
``exp`` is used instead; the selftest certifies that its vector and scalar paths agree.
"""

from __future__ import annotations

import torch
from torch import Tensor


def rmsnorm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    xf = x.float()
    variance = xf.pow(2).mean(-1, keepdim=True)
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
    return xf / (torch.exp(-xf) + 1.0)


def swiglu(gate: Tensor, up: Tensor) -> Tensor:
    return (silu(gate) * up.float()).to(gate.dtype)
