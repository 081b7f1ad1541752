"""RMSNorm, RoPE and SwiGLU in one native call each (``rowwise.c`` states their arithmetic).

These are the forward steps of the reference backend's row-wise operators for fp32 and bf16 CPU
tensors: one call instead of the handful of small torch ops each takes, which dominate a decode
step at small batch. Under autograd the same forwards run inside ``kernels.spec.elementwise``'s
autograd functions (SwiGLU's analytic backward is native too: ``swiglu_backward``). ``rope`` gives
the bits of the torch expression for every finite and infinite value (a NaN stays a NaN; its bf16
payload may differ from torch's vectorised cast), so its training path stays torch (asserted by the
tests).
"""

from __future__ import annotations

import torch
from torch import Tensor

from . import _operand_dtype_ok, library

_BF16 = torch.bfloat16


def supported(*ts: Tensor) -> bool:
    """Whether the native row-wise kernels take these operands (fp32/bf16 on CPU)."""
    return all(_operand_dtype_ok(t) for t in ts)


def _require(name: str, *ts: Tensor) -> None:
    if not supported(*ts):
        raise ValueError(f"{name}: the native kernel takes fp32/bf16 CPU tensors, got "
                         f"{', '.join(f'{t.dtype} on {t.device}' for t in ts)}")


def _rows(t: Tensor, width: int) -> Tensor:
    """``t`` as ``[rows, width]`` with a unit inner stride (a view when possible)."""
    r = t.reshape(-1, width)
    return r if r.stride(-1) == 1 and (r.shape[0] <= 1 or r.stride(0) >= width) else r.contiguous()


def _threads(threads: int | None) -> int:
    return threads or torch.get_num_threads()


def rmsnorm(x: Tensor, weight: Tensor, eps: float, *, portable: bool = False, threads: int | None = None) -> Tensor:
    """RMSNorm over the last dim (no autograd): bf16 out when ``x`` and ``weight`` both are, else fp32."""
    _require("rmsnorm", x, weight)
    h = x.shape[-1]
    if weight.shape != (h,):
        raise ValueError(f"rmsnorm: weight {tuple(weight.shape)} does not match the last dim {h}")
    xr, w = _rows(x, h), weight.contiguous()
    out_dtype = _BF16 if x.dtype == _BF16 and weight.dtype == _BF16 else torch.float32
    out = torch.empty(*x.shape, dtype=out_dtype)
    if xr.shape[0]:
        library().rmsnorm_rows(xr.data_ptr(), int(x.dtype == _BF16), xr.stride(0), w.data_ptr(),
                               int(w.dtype == _BF16), out.data_ptr(), int(out_dtype == _BF16), xr.shape[0], h,
                               eps, _threads(threads), int(portable))
    return out


def rope(x: Tensor, cos: Tensor, sin: Tensor, *, threads: int | None = None) -> Tensor:
    """Rotary embedding of ``x [N, H, D]`` with fp32 ``cos``/``sin [N, D]`` in ``x``'s dtype (no autograd)."""
    _require("rope", x, cos, sin)
    n, heads, d = x.shape
    if cos.shape != (n, d) or sin.shape != (n, d) or d % 2:
        raise ValueError(f"rope: x {tuple(x.shape)} needs fp32 cos/sin [{n}, {d}] and an even head dim")
    if x.stride(-1) != 1:
        x = x.contiguous()
    c, s = cos.float().contiguous(), sin.float().contiguous()
    out = torch.empty(*x.shape, dtype=x.dtype)
    if x.numel():
        library().rope_rows(x.data_ptr(), int(x.dtype == _BF16), x.stride(0), x.stride(1), c.data_ptr(), s.data_ptr(),
                            out.data_ptr(), n, heads, d, _threads(threads))
    return out


def swiglu(gate: Tensor, up: Tensor, *, portable: bool = False, threads: int | None = None) -> Tensor:
    """``silu(gate) * up`` in ``gate``'s dtype (no autograd), with the kernels' own ``exp_``."""
    _require("swiglu", gate, up)
    if gate.shape != up.shape:
        raise ValueError(f"swiglu: gate {tuple(gate.shape)} and up {tuple(up.shape)} differ")
    width = gate.shape[-1]
    g, u = _rows(gate, width), _rows(up, width)
    out = torch.empty(*gate.shape, dtype=gate.dtype)
    if g.shape[0]:
        library().swiglu_rows(g.data_ptr(), int(g.dtype == _BF16), g.stride(0), u.data_ptr(), int(u.dtype == _BF16),
                              u.stride(0), out.data_ptr(), g.shape[0], width, _threads(threads), int(portable))
    return out


def swiglu_backward(gate: Tensor, up: Tensor, grad: Tensor, *, threads: int | None = None) -> tuple[Tensor, Tensor]:
    """SwiGLU's analytic gradient in one pass: ``(d_gate, d_up)`` in the dtypes of ``gate`` and ``up``."""
    _require("swiglu_backward", gate, up, grad)
    if not gate.shape == up.shape == grad.shape:
        raise ValueError(f"swiglu_backward: gate {tuple(gate.shape)}, up {tuple(up.shape)} and grad "
                         f"{tuple(grad.shape)} differ")
    width = gate.shape[-1]
    g, u, d = _rows(gate, width), _rows(up, width), _rows(grad, width)
    d_gate, d_up = torch.empty(*gate.shape, dtype=gate.dtype), torch.empty(*up.shape, dtype=up.dtype)
    if g.shape[0]:
        library().swiglu_backward_rows(g.data_ptr(), int(g.dtype == _BF16), g.stride(0), u.data_ptr(),
                                       int(u.dtype == _BF16), u.stride(0), d.data_ptr(), int(d.dtype == _BF16),
                                       d.stride(0), d_gate.data_ptr(), d_up.data_ptr(), g.shape[0], width,
                                       _threads(threads))
    return d_gate, d_up
