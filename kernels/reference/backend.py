"""``ReferenceBackend``: wires the reference operators to the ``Backend`` interface."""

from __future__ import annotations

import torch
from torch import Tensor

from ..backend import Backend, MoERouting
from ..kv import AttentionBatch, KVSource
from . import elementwise, moe
from .attention import attention
from .linear import chunked_bmm, column_chunked_linear, tiled_linear


class ReferenceBackend(Backend):
    name = "reference"

    def linear(self, x: Tensor, weight: Tensor) -> Tensor:
        return tiled_linear(x, weight, self.config.row_tile)

    def chunk_partials(self, x: Tensor, chunks: Tensor) -> Tensor:
        return chunked_bmm(x, chunks, self.config.row_tile)

    def rmsnorm(self, x: Tensor, weight: Tensor, eps: float) -> Tensor:
        return elementwise.rmsnorm(x, weight, eps)

    def rope(self, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        return elementwise.rope(x, cos, sin)

    def attention(self, q: Tensor, kv: KVSource, batch: AttentionBatch, scale: float) -> Tensor:
        return attention(q, kv, batch, scale, row_tile=self.config.row_tile, kv_tile=self.config.kv_tile)

    def swiglu(self, gate: Tensor, up: Tensor) -> Tensor:
        return elementwise.swiglu(gate, up)

    def moe_route(self, router_logits: Tensor, top_k: int, normalize: bool) -> MoERouting:
        return moe.route(router_logits, top_k, normalize)

    def moe_combine(self, expert_out: Tensor, routing: MoERouting) -> Tensor:
        return moe.combine(expert_out, routing)

    def logprobs(self, hidden: Tensor, lm_head: Tensor, temperature: Tensor) -> Tensor:
        h, w = hidden.float(), lm_head.float()
        if torch.is_grad_enabled() and (h.requires_grad or w.requires_grad):
            logits = tiled_linear(h, w, self.config.row_tile)
        else:  # the same bits (certified column-slice invariance), faster for few rows
            logits = column_chunked_linear(h, w, self.config.row_tile)
        return torch.log_softmax(logits / temperature[:, None], dim=-1)
