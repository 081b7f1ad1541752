"""Where attention reads its keys and values from: whole sequences or a paged cache.

``AttentionBatch`` says, for every query row, which sequence it belongs to and its absolute
position. A K/V source is either ``ContiguousKV`` (training forward, packed sequences) or
``PagedKV`` (rollout engine: page table + pages). Each source names the row of every (sequence,
position) in a flat ``[rows, Hkv, D]`` view of its storage (``slots``), so every path feeds the same
tile routine by indexing alone (no arithmetic): the reference backend's native attention reads the
storage rows in place through that index; the torch tile routine (Ascend's specification) and the
fast backend build a dense copy from it with one row gather.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TypeVar

import torch
from torch import Tensor

_T = TypeVar("_T")


@dataclass(frozen=True)
class AttentionBatch:
    """Query rows of one attention call, grouped by sequence.

    ``q_index[s, i]`` is the packed query row of the i-th query of sequence ``s`` (or ``-1``),
    ``q_pos[s, i]`` its absolute position (0 for padding), ``kv_lens[s]`` the number of K/V
    positions sequence ``s`` may read (its queries see positions ``<= q_pos``).
    """

    q_index: Tensor  # [S, Mq] int64
    q_pos: Tensor  # [S, Mq] int64
    kv_lens: Tensor  # [S] int64
    num_rows: int
    max_kv_len: int
    _memo: dict[object, object] = field(default_factory=dict, init=False, repr=False, compare=False)

    @property
    def num_seqs(self) -> int:
        return int(self.q_index.shape[0])

    def memo(self, key: object, make: Callable[[], _T]) -> _T:
        """``make()``, computed once per batch: index tensors and masks every layer of a forward
        needs alike (pure functions of the batch and ``key``)."""
        if key not in self._memo:
            self._memo[key] = make()
        return self._memo[key]  # type: ignore[return-value]

    @staticmethod
    def build(q_lens: list[int], q_starts: list[int], kv_lens: list[int], device: torch.device | str = "cpu",
              ) -> AttentionBatch:
        """Sequence ``s`` owns packed query rows ``[sum(q_lens[:s]), +q_lens[s])`` at positions
        ``q_starts[s] ..``; it may read ``kv_lens[s] >= q_starts[s] + q_lens[s]`` K/V positions."""
        if not (len(q_lens) == len(q_starts) == len(kv_lens)) or not q_lens:
            raise ValueError("q_lens, q_starts and kv_lens must be equally long and non-empty")
        mq = max(q_lens)
        q_index: list[int] = []
        q_pos: list[int] = []
        row = 0
        for s, (n, start, kv) in enumerate(zip(q_lens, q_starts, kv_lens, strict=True)):
            if n < 1 or start < 0 or kv < start + n:
                raise ValueError(f"sequence {s}: q_len={n}, q_start={start}, kv_len={kv} are inconsistent")
            n, start = int(n), int(start)
            q_index.extend(range(row, row + n))
            q_index.extend([-1] * (mq - n))
            q_pos.extend(range(start, start + n))
            q_pos.extend([0] * (mq - n))
            row += n
        shape = (len(q_lens), mq)
        return AttentionBatch(
            q_index=torch.tensor(q_index, dtype=torch.int64, device=device).view(shape),
            q_pos=torch.tensor(q_pos, dtype=torch.int64, device=device).view(shape),
            kv_lens=torch.tensor(kv_lens, dtype=torch.int64, device=device),
            num_rows=row, max_kv_len=max(kv_lens),
        )


@dataclass(frozen=True)
class ContiguousKV:
    """Keys/values of packed sequences: sequence ``s`` owns rows ``cu_seqlens[s]:cu_seqlens[s+1]``."""

    k: Tensor  # [Nk, Hkv, D]
    v: Tensor  # [Nk, Hkv, D]
    cu_seqlens: Tensor  # [S+1] int64

    def slots(self, length: int) -> Tensor:
        """``[S, length]`` rows of ``k``/``v``; rows past a sequence's end name other (finite) rows
        and are always masked."""
        starts = self.cu_seqlens[:-1, None]
        return (starts + torch.arange(length, device=starts.device)).clamp_(max=self.k.shape[0] - 1)

    def flat(self) -> tuple[Tensor, Tensor]:
        return self.k, self.v

    def dense(self, length: int) -> tuple[Tensor, Tensor]:
        """Fresh ``[S, length, Hkv, D]`` copies of every sequence's keys and values."""
        return dense(self, length)


@dataclass(frozen=True)
class PagedKV:
    """A paged K/V cache: ``page_table[s, j]`` is the page holding positions
    ``[j*page_size, (j+1)*page_size)`` of sequence ``s`` (unused entries point at any valid page)."""

    k_pages: Tensor  # [P, page_size, Hkv, D]
    v_pages: Tensor  # [P, page_size, Hkv, D]
    page_table: Tensor  # [S, max_pages] int64
    zero_row: int | None = None
    """A flat row (``flat()`` view) that holds zeros in both K and V and is never written (the rollout
    cache reserves one page for it), or None. Attention points the slots past a sequence's end at
    it instead of zeroing those rows of its V copy."""

    @property
    def page_size(self) -> int:
        return int(self.k_pages.shape[1])

    def slots(self, length: int) -> Tensor:
        """``[S, length]`` rows of the flattened pages: position ``p`` of sequence ``s`` is row
        ``page_table[s, p // page_size] * page_size + p % page_size``."""
        pages = -(-length // self.page_size)
        if pages > self.page_table.shape[1]:
            raise ValueError(f"page table has {self.page_table.shape[1]} pages, {pages} needed")
        pos = torch.arange(length, device=self.page_table.device)
        return self.page_table[:, pos // self.page_size] * self.page_size + pos % self.page_size

    def flat(self) -> tuple[Tensor, Tensor]:
        return (self.k_pages.reshape(-1, *self.k_pages.shape[2:]), self.v_pages.reshape(-1, *self.v_pages.shape[2:]))

    def dense(self, length: int) -> tuple[Tensor, Tensor]:
        """Fresh ``[S, length, Hkv, D]`` copies of every sequence's keys and values (unused table
        entries and slots past a sequence's end hold other, finite, rows)."""
        return dense(self, length)


KVSource = ContiguousKV | PagedKV


@dataclass(frozen=True)
class PagedCacheWrite:
    """One forward pass's view of a paged cache of every layer, ``k``/``v [layers, P, page_size, Hkv,
    D]``: new row ``n`` goes to flat slot ``slots[n]`` (of the ``[P * page_size, Hkv, D]`` view of a
    layer) and attention reads layer ``i`` as ``layer(i)``."""

    k: Tensor
    v: Tensor
    page_table: Tensor  # [S, max_pages] int64
    slots: Tensor  # [N] int64
    zero_row: int | None = None

    def layer(self, i: int) -> PagedKV:
        return PagedKV(self.k[i], self.v[i], self.page_table, zero_row=self.zero_row)

    def write(self, i: int, k: Tensor, v: Tensor) -> PagedKV:
        """Writes the new rows' ``k``/``v [N, Hkv, D]`` into layer ``i`` (cast to the cache's dtype)
        and returns the layer as attention reads it."""
        kc, vc = self.k[i], self.v[i]
        # a block copy per row, cheaper than []= (which also cast; .to is free when the dtypes agree)
        kc.view(-1, *kc.shape[2:]).index_copy_(0, self.slots, k.to(kc.dtype))
        vc.view(-1, *vc.shape[2:]).index_copy_(0, self.slots, v.to(vc.dtype))
        return PagedKV(kc, vc, self.page_table, zero_row=self.zero_row)


def zero_row(kv: KVSource) -> int | None:
    """The source's all-zero flat row (``PagedKV.zero_row``), if it has one."""
    return kv.zero_row if isinstance(kv, PagedKV) else None


def layout_key(kv: KVSource) -> tuple[object, ...]:
    """What ``kv.slots(length)`` depends on besides ``length``: the source's index tensor (by
    identity, kept alive by the caller's memo) and sizes. Equal keys give equal slots."""
    if isinstance(kv, PagedKV):
        return ("paged", id(kv.page_table), kv.page_size, kv.zero_row)
    return ("contiguous", id(kv.cu_seqlens), int(kv.k.shape[0]))


def dense_heads(kv: KVSource, rows: Tensor) -> tuple[Tensor, Tensor]:
    """Fresh head-major ``[S, Hkv, L, D]`` copies of every sequence's keys and values in one gather:
    ``rows [S, Hkv, L]`` names, for every (sequence, head, position), a row of the
    ``[rows * Hkv, D]`` view of the storage (see :func:`head_slots`). Pure indexing: the values equal
    ``dense(kv, L)`` transposed to head-major, without the second (transposing) copy."""
    k, v = kv.flat()
    d = k.shape[2]
    idx = rows.reshape(-1)
    shape = (*rows.shape, d)
    return k.reshape(-1, d).index_select(0, idx).view(shape), v.reshape(-1, d).index_select(0, idx).view(shape)


def head_slots(slots: Tensor, num_kv_heads: int) -> Tensor:
    """``[S, Hkv, L]`` rows of the ``[rows * Hkv, D]`` view for ``slots [S, L]`` rows of ``[rows, Hkv, D]``."""
    heads = torch.arange(num_kv_heads, device=slots.device)
    return slots[:, None, :] * num_kv_heads + heads[None, :, None]


def dense(kv: KVSource, length: int) -> tuple[Tensor, Tensor]:
    """Whole ``[Hkv, D]`` rows copied with ``index_select`` (a block copy per row; several times
    faster on CPU than advanced indexing, which copies element by element)."""
    k, v = kv.flat()
    slots = kv.slots(length)
    shape = (*slots.shape, *k.shape[1:])
    return k.index_select(0, slots.reshape(-1)).view(shape), v.index_select(0, slots.reshape(-1)).view(shape)
