"""``ReferenceBackend`` (backend name ``reference``): the consistent operator set on CPU.

Its arithmetic is the native kernels of ``onpolicy.kernels.cpu`` (rowdot linears, the attention
tile routine, RMSNorm/RoPE/SwiGLU, the one-call decoder), each with its order of additions fixed
by its own loop, so batch-, schedule-, thread- and ISA-invariant by construction (contract 5,
docs/numerics.md); the torch forms of ``onpolicy.kernels.spec`` carry autograd and what the native
kernels do not take. ``onpolicy selftest`` certifies it per machine.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import torch
from torch import Tensor

from . import cpu
from .backend import SINGLE, Backend, DenseStack, MoERouting, RowWeight, ShardGroup
from .cpu import rowwise
from .cpu.attention import attention as native_attention
from .cpu.stack import decoder_stack as native_stack
from .kv import AttentionBatch, KVSource, PagedCacheWrite
from .spec import elementwise, moe


class ReferenceBackend(Backend):
    name = "reference"

    groups_projections = True

    def linear(self, x: Tensor, weight: Tensor) -> Tensor:
        return cpu.linear(x, weight)

    def linears(self, x: Tensor, weights: Sequence[Tensor]) -> list[Tensor]:
        # one rowdot_group call without autograd (every element is rowdot's: the bits of each linear)
        return cpu.linears(x, weights)

    def row_linear(self, x: Tensor, weight: RowWeight, group: ShardGroup = SINGLE) -> Tensor:
        """The canonical reduction of ``Backend.row_linear``; unsharded, partials and fold run inside
        one ``rowdot`` call (the same bits: the kernel folds as ``fold_chunks`` does)."""
        if group is SINGLE and x.dtype in (torch.float32, torch.bfloat16):
            return cpu.chunked_linear(x, weight.chunked(self.config.reduce_chunks), fold=True)
        return super().row_linear(x, weight, group)

    def chunk_partials(self, x: Tensor, chunks: Tensor) -> Tensor:
        # one call for all of the rank's chunks; a partial's bits depend only on its own chunk
        if x.dtype in (torch.float32, torch.bfloat16):
            return cpu.chunked_linear(x, chunks, fold=False)
        return super().chunk_partials(x, chunks)

    def decoder_stack(self, x: Tensor, stack: DenseStack, cos: Tensor, sin: Tensor, cache: PagedCacheWrite,
                      batch: AttentionBatch) -> Tensor | None:
        # kernels/cpu/stack.c: the native kernels below, chained in C (fp32/bf16, no autograd) — not
        # for a subclass that overrides one of them (the stack would skip its override)
        if not _own_operators(type(self)):
            return None
        return native_stack(x, stack, cos, sin, cache, batch, kv_tile=self.config.kv_tile,
                            chunks=self.config.reduce_chunks)

    def rmsnorm(self, x: Tensor, weight: Tensor, eps: float) -> Tensor:
        if rowwise.supported(x, weight):
            return elementwise.rmsnorm(x, weight, eps, forward=rowwise.rmsnorm)
        return elementwise.rmsnorm(x, weight, eps)

    def rope(self, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        # the native kernel gives the torch expression's bits; autograd keeps the torch ops
        if rowwise.supported(x) and not (torch.is_grad_enabled() and x.requires_grad):
            return rowwise.rope(x, cos, sin)
        return elementwise.rope(x, cos, sin)

    def attention(self, q: Tensor, kv: KVSource, batch: AttentionBatch, scale: float) -> Tensor:
        # the tile routine in C (kernels/cpu/attention.c): K/V read in place through an index
        return native_attention(q, kv, batch, scale, kv_tile=self.config.kv_tile)

    def swiglu(self, gate: Tensor, up: Tensor) -> Tensor:
        if rowwise.supported(gate, up):
            return elementwise.swiglu(gate, up, forward=rowwise.swiglu, backward=rowwise.swiglu_backward)
        return elementwise.swiglu(gate, up)

    def moe_route(self, router_logits: Tensor, top_k: int, normalize: bool) -> MoERouting:
        return moe.route(router_logits, top_k, normalize)

    def moe_combine(self, expert_out: Tensor, routing: MoERouting) -> Tensor:
        return moe.combine(expert_out, routing)

    def lm_logits(self, hidden: Tensor, lm_head: Tensor) -> Tensor:
        # fp32 logits; a bf16 LM head is widened inside rowdot (exact) instead of copied to fp32
        return cpu.linear(hidden.float(), lm_head)


#: The operators ``decoder_stack`` runs natively in their place.
_STACKED = ("linear", "linears", "row_linear", "chunk_partials", "rmsnorm", "rope", "attention", "swiglu")


@functools.cache
def _own_operators(cls: type) -> bool:
    """Whether ``cls`` runs ReferenceBackend's own ``_STACKED`` operators (no override)."""
    return all(getattr(cls, name) is getattr(ReferenceBackend, name) for name in _STACKED)
