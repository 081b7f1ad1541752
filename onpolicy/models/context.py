"""Attention contexts: how a forward pass's layers find their keys and values.

The model is the same for both engines; only the context differs. ``PackedContext`` serves the
training path (packed variable-length sequences, K/V are the layer's own rows); the rollout engine
provides a paged context that writes new K/V into its cache and reads it back as ``PagedKV``.
"""

from __future__ import annotations

from typing import Protocol

import torch
from torch import Tensor

from onpolicy.kernels import AttentionBatch, ContiguousKV, KVSource


class AttentionContext(Protocol):
    """``batch`` and ``kv``; a context over a paged cache may also have ``cache_write``
    (``PagedCacheWrite``), through which a backend can run every layer in one call."""

    batch: AttentionBatch

    def kv(self, layer: int, k: Tensor, v: Tensor) -> KVSource:
        """Keys/values layer ``layer`` attends over, given the new rows' ``k``/``v`` ``[N, Hkv, D]``."""
        ...


class PackedContext:
    """Whole sequences packed back to back: every sequence attends over its own rows."""

    def __init__(self, seq_lens: list[int], device: torch.device | str = "cpu") -> None:
        self.batch = AttentionBatch.build(seq_lens, [0] * len(seq_lens), seq_lens, device)
        cu = [0]
        for n in seq_lens:
            cu.append(cu[-1] + n)
        self.cu_seqlens = torch.tensor(cu, dtype=torch.int64, device=device)
        self.positions = torch.cat([torch.arange(n, device=device) for n in seq_lens])

    def kv(self, layer: int, k: Tensor, v: Tensor) -> KVSource:
        return ContiguousKV(k, v, self.cu_seqlens)
