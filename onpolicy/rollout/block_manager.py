"""``BlockManager``: plain-Python bookkeeping of KV pages — free list, reference counts and the
prefix cache of full pages keyed by their token chain. Never touches tensors."""

from __future__ import annotations

from collections import OrderedDict

from .sequence import Sequence

PageKey = tuple[object, tuple[int, ...]]


class BlockManager:
    def __init__(self, num_pages: int, page_size: int, prefix_cache: bool) -> None:
        if num_pages < 1:
            raise ValueError("the KV cache needs at least one page")
        self.num_pages, self.page_size, self.prefix_cache = num_pages, page_size, prefix_cache
        self.ref = [0] * num_pages
        self.free: OrderedDict[int, None] = OrderedDict((p, None) for p in range(num_pages))  # LRU first
        self.page_key: list[PageKey | None] = [None] * num_pages
        self.cached: dict[PageKey, int] = {}
        self.hits = 0  # pages reused from the prefix cache

    @property
    def num_free(self) -> int:
        return len(self.free)

    def pages_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

    def _chain(self, tokens: list[int], num_pages: int) -> list[PageKey]:
        keys: list[PageKey] = []
        prev: object = None
        for i in range(num_pages):
            key = (prev, tuple(tokens[i * self.page_size:(i + 1) * self.page_size]))
            keys.append(key)
            prev = key
        return keys

    def _take(self, page: int) -> None:
        self.free.pop(page, None)
        self.ref[page] += 1

    def _alloc_fresh(self) -> int:
        page, _ = self.free.popitem(last=False)
        key = self.page_key[page]
        if key is not None and self.cached.get(key) == page:
            del self.cached[key]
        self.page_key[page] = None
        self.ref[page] = 1
        return page

    def cached_prefix(self, seq: Sequence) -> list[int]:
        """Pages of the prefix cache covering full pages of ``seq.tokens[:-1]`` (the last token is
        always computed, so the engine has its logits)."""
        if not self.prefix_cache:
            return []
        full = (len(seq.tokens) - 1) // self.page_size
        pages = []
        for key in self._chain(seq.tokens, full):
            page = self.cached.get(key)
            if page is None:
                break
            pages.append(page)
        return pages

    def admit(self, seq: Sequence, first_chunk: int) -> bool:
        """Attach cached prefix pages and allocate pages for ``first_chunk`` more tokens, or change
        nothing and return False if the cache cannot hold them."""
        prefix = self.cached_prefix(seq)
        computed = len(prefix) * self.page_size
        need = self.pages_for(computed + first_chunk) - len(prefix)
        reusable_free = sum(1 for p in prefix if p in self.free)
        if need > self.num_free - reusable_free:
            return False
        for p in prefix:
            self._take(p)
        seq.block_table = list(prefix)
        seq.num_cached_pages = len(prefix)
        seq.num_computed = computed
        self.hits += len(prefix)
        for _ in range(need):
            seq.block_table.append(self._alloc_fresh())
        return True

    def can_grow(self, seq: Sequence, num_tokens: int) -> bool:
        return self.pages_for(num_tokens) - len(seq.block_table) <= self.num_free

    def grow(self, seq: Sequence, num_tokens: int) -> None:
        """Make ``seq``'s pages cover ``num_tokens`` positions (caller checked ``can_grow``)."""
        while len(seq.block_table) < self.pages_for(num_tokens):
            seq.block_table.append(self._alloc_fresh())

    def shrink(self, seq: Sequence, num_tokens: int) -> None:
        """Free ``seq``'s trailing pages beyond ``num_tokens`` positions (rejected drafted tokens):
        they hold no position that is computed, so they are never in the prefix cache."""
        keep = self.pages_for(num_tokens)
        while len(seq.block_table) > keep:
            page = seq.block_table.pop()
            self.ref[page] -= 1
            if self.ref[page] == 0:
                self.free[page] = None

    def register_full_pages(self, seq: Sequence) -> None:
        """Publish ``seq``'s computed full pages in the prefix cache."""
        if not self.prefix_cache:
            return
        full = seq.num_computed // self.page_size
        for i, key in enumerate(self._chain(seq.tokens, full)):
            page = seq.block_table[i]
            if self.page_key[page] is None and key not in self.cached:
                self.page_key[page] = key
                self.cached[key] = page

    def release(self, seq: Sequence) -> None:
        """Drop ``seq``'s pages; pages that are in the prefix cache stay there until reused."""
        for page in reversed(seq.block_table):
            self.ref[page] -= 1
            if self.ref[page] == 0:
                self.free[page] = None
        seq.block_table = []
        seq.num_cached_pages = 0
        seq.num_computed = 0

    def reset_prefix_cache(self) -> None:
        """Forget every cached page (weights changed, so cached K/V are stale)."""
        self.cached.clear()
        self.page_key = [None] * self.num_pages
