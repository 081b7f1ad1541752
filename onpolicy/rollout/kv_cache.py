"""``KVCache`` (the page tensors) and ``PagedContext`` (the attention context of one engine step):
new K/V rows are written to their slots, and attention reads every sequence through its page table
as ``PagedKV`` — the same tile routine the trainer runs over whole sequences."""

from __future__ import annotations

import torch
from torch import Tensor

from onpolicy.kernels import AttentionBatch, KVSource, PagedKV


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
        self.cache, self.batch, self.page_table, self.slots = cache, batch, page_table, slots

    def kv(self, layer: int, k: Tensor, v: Tensor) -> KVSource:
        kc, vc = self.cache.k[layer], self.cache.v[layer]
        # a block copy per row, cheaper than []= (which also cast; .to is free when the dtypes agree)
        kc.view(-1, *kc.shape[2:]).index_copy_(0, self.slots, k.to(kc.dtype))
        vc.view(-1, *vc.shape[2:]).index_copy_(0, self.slots, v.to(vc.dtype))
        return PagedKV(kc, vc, self.page_table, zero_row=self.cache.zero_row)
