"""``KVCache`` (the page tensors) and ``PagedContext`` (the attention context of one engine step):
new K/V rows are written to their slots, and attention reads every sequence through its page table
as ``PagedKV`` — the same tile routine the trainer runs over whole sequences. The context's
``cache_write`` also lets a backend run every layer in one call (``Backend.decoder_stack``)."""

from __future__ import annotations

import torch
from torch import Tensor

from onpolicy.kernels import AttentionBatch, KVSource
from onpolicy.kernels.kv import PagedCacheWrite


class KVCache:
    def __init__(self, num_layers: int, num_pages: int, page_size: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device | str = "cpu") -> None:
        # zero-filled: never-written slots are finite, so masked positions contribute exact zeros.
        # One page more than the block manager hands out: it is never written, and attention points
        # every position past a sequence's end at its first row (``zero_row``) instead of zeroing them.
        shape = (num_layers, num_pages + 1, page_size, num_kv_heads, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.page_size = page_size
        self.zero_row = num_pages * page_size

    @staticmethod
    def bytes_per_page(num_layers: int, page_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        return 2 * num_layers * page_size * num_kv_heads * head_dim * torch.finfo(dtype).bits // 8


class PagedContext:
    def __init__(self, cache: KVCache, batch: AttentionBatch, page_table: Tensor, slots: Tensor) -> None:
        self.batch = batch
        self.cache_write = PagedCacheWrite(cache.k, cache.v, page_table, slots, zero_row=cache.zero_row)

    def kv(self, layer: int, k: Tensor, v: Tensor) -> KVSource:
        return self.cache_write.write(layer, k, v)
