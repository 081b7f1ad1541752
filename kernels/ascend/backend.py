"""``AscendBackend``: the consistent operator set on Ascend NPUs.

Provider ``onpolicy`` (preferred): every attention — training forward/backward, prefill, chunked
prefill, paged decode — runs the one Ascend C tile routine (``torch.ops.onpolicy.flash_attention``
/ ``flash_attention_grad`` / ``paged_attention``); linear and the LM head run the batch-invariant
``onpolicy.matmul``; RMSNorm and the temperature log-softmax run ``onpolicy.rms_norm`` /
``onpolicy.log_softmax``. RoPE, SwiGLU and MoE routing/combine are the reference backend's
elementwise torch code on the NPU (no reductions across rows; certified by the selftest).

Provider ``vendor``: the reference tile routine with Huawei's batch-invariant GEMM / reduce-sum
(:mod:`.vendor`).

Gradients: the training attention uses the Ascend C backward kernel; the other kernel-forward ops
use the kernel for the forward value (so training and rollout forwards share bits) and the
reference formula for the backward (deterministic torch ops). Tensors may come from the CPU
(e.g. ``onpolicy selftest``): they are moved to the NPU and results are moved back.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from ..backend import Backend, MoERouting
from ..config import KernelConfig
from ..kv import AttentionBatch, ContiguousKV, KVSource, PagedKV
from ..spec import elementwise, moe
from ..spec.attention import attention as reference_attention
from ..spec.linear import pad_rows
from . import vendor
from .env import apply_deterministic_env, configure_torch_npu
from .marshal import attention_args, block_row_tiles, scatter_rows
from .runtime import Provider, detect_provider, import_torch_npu


class _ReferenceGrad(torch.autograd.Function):
    """Forward by a kernel, backward by the vector-Jacobian product of the reference formula."""

    @staticmethod
    def forward(ctx: Any, kernel: Callable[..., Tensor], reference: Callable[..., Tensor], *inputs: Tensor) -> Tensor:
        ctx.reference = reference
        ctx.save_for_backward(*inputs)
        return kernel(*inputs)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:
        inputs = [t.detach().requires_grad_(need) for t, need in zip(ctx.saved_tensors, ctx.needs_input_grad[2:],
                                                                        strict=True)]
        wanted = [t for t in inputs if t.requires_grad]
        with torch.enable_grad():
            out = ctx.reference(*inputs)
        grads = iter(torch.autograd.grad(out, wanted, grad, allow_unused=True))
        return (None, None, *(next(grads) if t.requires_grad else None for t in inputs))


class _Matmul(torch.autograd.Function):
    """``x @ w.T`` by the batch-invariant kernel, forward and backward."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, w: Tensor, ops: Any) -> Tensor:
        ctx.save_for_backward(x, w)
        ctx.ops = ops
        return ops.matmul(x, w)

    @staticmethod
    def backward(ctx: Any, dy: Tensor) -> tuple[Tensor | None, Tensor | None, None]:
        x, w = ctx.saved_tensors
        dy = dy.contiguous()
        dx = ctx.ops.matmul(dy, w.t().contiguous()) if ctx.needs_input_grad[0] else None
        dw = ctx.ops.matmul(dy.t().contiguous(), x.t().contiguous()) if ctx.needs_input_grad[1] else None
        return dx, dw, None


class _FlashAttention(torch.autograd.Function):
    """Training attention: Ascend C forward (saving the softmax LSE) and Ascend C backward."""

    @staticmethod
    def forward(ctx: Any, q: Tensor, k: Tensor, v: Tensor, seq_meta: Tensor, scale: float, kv_tile: int,
                row_tile: int, row_tiles: int, ops: Any) -> Tensor:
        out, lse = ops.flash_attention(q, k, v, seq_meta, scale, kv_tile, row_tile, row_tiles)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.args = (seq_meta, scale, kv_tile, row_tile, row_tiles, ops)
        return out

    @staticmethod
    def backward(ctx: Any, dout: Tensor) -> tuple[Tensor | None, ...]:
        q, k, v, out, lse = ctx.saved_tensors
        seq_meta, scale, kv_tile, row_tile, row_tiles, ops = ctx.args
        dq, dk, dv = ops.flash_attention_grad(q, k, v, out, dout.contiguous(), lse, seq_meta, scale, kv_tile,
                                              row_tile, row_tiles)
        return dq, dk, dv, None, None, None, None, None, None


def _needs_grad(*tensors: Tensor) -> bool:
    return torch.is_grad_enabled() and any(t.requires_grad for t in tensors)


class AscendBackend(Backend):
    name = "ascend"

    def __init__(self, config: KernelConfig, *, ops: Any | None = None, device: torch.device | str | None = None,
                 ) -> None:
        """``ops``/``device`` inject an operator namespace with the ``torch.ops.onpolicy`` schema
        (tests run a CPU emulation of the kernels this way); by default the provider is detected
        and the deterministic environment is applied."""
        super().__init__(config)
        self.row_tiles = block_row_tiles(config)
        if ops is not None:
            self.provider = Provider.ONPOLICY
            self._ops = ops
            self.device = torch.device(device if device is not None else "cpu")
            return
        apply_deterministic_env()
        self.provider = detect_provider()  # raises AscendUnavailable with the docs pointer
        import_torch_npu()
        configure_torch_npu()
        self._ops = torch.ops.onpolicy if self.provider is Provider.ONPOLICY else None
        self.device = torch.device("npu", torch.npu.current_device())

    @property
    def fingerprint(self) -> str:
        """The config's fingerprint plus the operator provider (their bits differ)."""
        return f"{self.config.fingerprint}+{self.provider.value}"

    # -- device handling -------------------------------------------------------------------------

    def _dev(self, t: Tensor) -> Tensor:
        return t if t.device == self.device else t.to(self.device)

    def _home(self, t: Tensor, like: Tensor) -> Tensor:
        return t if t.device == like.device else t.to(like.device)

    def _kernel(self, kernel: Callable[..., Tensor], reference: Callable[..., Tensor], *inputs: Tensor) -> Tensor:
        if _needs_grad(*inputs):
            return _ReferenceGrad.apply(kernel, reference, *inputs)
        return kernel(*inputs)

    # -- operators -------------------------------------------------------------------------------

    def _matmul(self, x: Tensor, w: Tensor) -> Tensor:
        """Rows padded to the row tile, then the batch-invariant kernel (its M tiling is fixed; the
        padding keeps every call in one shape class)."""
        n = x.shape[0]
        xp = pad_rows(x, self.config.row_tile)
        if self.provider is Provider.VENDOR:
            return self._kernel(lambda a, b: vendor.mm(a, b.t()), lambda a, b: a @ b.t(), xp, w)[:n]
        if _needs_grad(xp, w):
            return _Matmul.apply(xp, w, self._ops)[:n]
        return self._ops.matmul(xp.contiguous(), w.contiguous())[:n]

    def linear(self, x: Tensor, weight: Tensor) -> Tensor:
        if x.dim() != 2:
            raise ValueError(f"linear expects 2-D input [N, K], got shape {tuple(x.shape)}")
        return self._home(self._matmul(self._dev(x), self._dev(weight)), x)

    def rmsnorm(self, x: Tensor, weight: Tensor, eps: float) -> Tensor:
        xd, wd = self._dev(x), self._dev(weight)
        if self.provider is Provider.VENDOR:
            out = self._kernel(lambda a, b: vendor.rmsnorm(a, b, eps),
                               lambda a, b: elementwise.rmsnorm(a, b, eps), xd, wd)
        else:
            out = self._kernel(lambda a, b: self._ops.rms_norm(a.contiguous(), b.contiguous(), eps),
                               lambda a, b: elementwise.rmsnorm(a, b, eps), xd, wd)
        return self._home(out, x)

    def rope(self, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        return self._home(elementwise.rope(self._dev(x), self._dev(cos), self._dev(sin)), x)

    def swiglu(self, gate: Tensor, up: Tensor) -> Tensor:
        return self._home(elementwise.swiglu(self._dev(gate), self._dev(up)), gate)

    def moe_route(self, router_logits: Tensor, top_k: int, normalize: bool) -> MoERouting:
        r = moe.route(self._dev(router_logits), top_k, normalize)
        return MoERouting(weights=self._home(r.weights, router_logits), experts=self._home(r.experts, router_logits))

    def moe_combine(self, expert_out: Tensor, routing: MoERouting) -> Tensor:
        r = MoERouting(weights=self._dev(routing.weights), experts=self._dev(routing.experts))
        return self._home(moe.combine(self._dev(expert_out), r), expert_out)

    def lm_logits(self, hidden: Tensor, lm_head: Tensor) -> Tensor:
        return self._home(self._matmul(self._dev(hidden).float(), self._dev(lm_head).float()), hidden)

    def logprobs_of_logits(self, logits: Tensor, temperature: Tensor) -> Tensor:
        z, t = self._dev(logits).float(), self._dev(temperature).float()
        out = self._kernel(lambda a, c: self._ops.log_softmax(a.contiguous(), c.contiguous()),
                           lambda a, c: torch.log_softmax(a / c[:, None], dim=-1), z, t)
        return self._home(out, logits)

    def logprobs(self, hidden: Tensor, lm_head: Tensor, temperature: Tensor) -> Tensor:
        if self.provider is not Provider.VENDOR:
            return super().logprobs(hidden, lm_head, temperature)
        h, w, t = self._dev(hidden).float(), self._dev(lm_head).float(), self._dev(temperature).float()
        out = self._kernel(lambda a, b, c: vendor.logprobs(a, b, c, self.config.row_tile),
                           lambda a, b, c: torch.log_softmax((a @ b.t()) / c[:, None], dim=-1), h, w, t)
        return self._home(out, hidden)

    def attention(self, q: Tensor, kv: KVSource, batch: AttentionBatch, scale: float) -> Tensor:
        c = self.config
        qd = self._dev(q)
        kv_d: KVSource
        if isinstance(kv, PagedKV):
            kv_d = PagedKV(self._dev(kv.k_pages), self._dev(kv.v_pages), kv.page_table)
        else:
            kv_d = ContiguousKV(self._dev(kv.k), self._dev(kv.v), kv.cu_seqlens)
        if self.provider is Provider.VENDOR:
            out = self._vendor_attention(qd, kv_d, batch, scale)
        else:
            out = self._onpolicy_attention(qd, kv_d, batch, scale, c)
        return self._home(out, q)

    def _vendor_attention(self, q: Tensor, kv: KVSource, batch: AttentionBatch, scale: float) -> Tensor:
        c = self.config
        tensors = (q, kv.k_pages, kv.v_pages) if isinstance(kv, PagedKV) else (q, kv.k, kv.v)

        def rebuild(kk: Tensor, vv: Tensor) -> KVSource:
            return PagedKV(kk, vv, kv.page_table) if isinstance(kv, PagedKV) else ContiguousKV(kk, vv, kv.cu_seqlens)

        def fwd(qq: Tensor, kk: Tensor, vv: Tensor) -> Tensor:
            return vendor.attention(qq, rebuild(kk, vv), batch, scale, row_tile=c.row_tile, kv_tile=c.kv_tile)

        def ref(qq: Tensor, kk: Tensor, vv: Tensor) -> Tensor:
            return reference_attention(qq, rebuild(kk, vv), batch, scale, row_tile=c.row_tile, kv_tile=c.kv_tile)

        return self._kernel(fwd, ref, *tensors)

    def _onpolicy_attention(self, q: Tensor, kv: KVSource, batch: AttentionBatch, scale: float,
                            c: KernelConfig) -> Tensor:
        args = attention_args(q, kv, batch, c.kv_tile)
        ops, rt = self._ops, self.row_tiles
        if args.paged:
            assert isinstance(kv, PagedKV)
            table = kv.page_table.to(self.device, torch.int32)

            def paged(qq: Tensor, kk: Tensor, vv: Tensor) -> Tensor:
                return ops.paged_attention(qq.contiguous(), kk.contiguous(), vv.contiguous(), table, args.seq_meta,
                                           scale, c.kv_tile, c.row_tile, rt)

            def paged_ref(qq: Tensor, kk: Tensor, vv: Tensor) -> Tensor:
                return _reference_on_packed(qq, PagedKV(kk, vv, kv.page_table), args, scale, c)

            out = self._kernel(paged, paged_ref, args.q, kv.k_pages, kv.v_pages)
        else:
            assert isinstance(kv, ContiguousKV)
            k, v = kv.k.contiguous(), kv.v.contiguous()
            if _needs_grad(args.q, k, v):
                out = _FlashAttention.apply(args.q.contiguous(), k, v, args.seq_meta, scale, c.kv_tile, c.row_tile,
                                            rt, ops)
            else:
                out, _ = ops.flash_attention(args.q.contiguous(), k, v, args.seq_meta, scale, c.kv_tile, c.row_tile,
                                             rt)
        return scatter_rows(out, args, batch.num_rows)


def _reference_on_packed(q: Tensor, kv: KVSource, args: Any, scale: float, c: KernelConfig) -> Tensor:
    """The reference attention on the operator's packed rows (backward of the paged path)."""
    meta = args.seq_meta
    q_lens, q_starts, kv_lens = meta[:, 1].tolist(), meta[:, 2].tolist(), meta[:, 4].tolist()
    batch = AttentionBatch.build(q_lens, q_starts, kv_lens, device=q.device)
    return reference_attention(q, kv, batch, scale, row_tile=c.row_tile, kv_tile=c.kv_tile)
