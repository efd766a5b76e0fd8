"""Page bookkeeping of a paged cache: which pages each slot holds, in position order, and
which are free, mirrored into the ``page_table`` tensor that ``varlen_attention`` (and the
drafter's context reads) index. Used by the target's ``model.kv_cache.KVCache`` and the
drafter's ``drafter.context_cache.DraftContextCache``; the caches own the storage.
"""
from __future__ import annotations

import heapq

import torch


class PageTable:
    """Pages of ``num_slots`` slots, each up to ``max_pages`` long, out of a pool.

    Attributes:
        table: [num_slots, max_pages] int64 on ``device``: slot s's j-th page id. Entries past
            a slot's pages (and rows of empty slots) name valid but unrelated pages (initially
            slot s's row is s * max_pages + j modulo num_pages) and must never be read
            unmasked.
        num_pages: pages in the pool (held or free).

    Args:
        num_slots, max_pages, num_pages: sizes (> 0).
        device: device of ``table``.
    """

    def __init__(self, num_slots: int, max_pages: int, num_pages: int,
                 device: torch.device | str):
        self.table = (torch.arange(num_slots * max_pages, device=device)
                      % num_pages).view(num_slots, max_pages)
        self.num_pages = num_pages
        self._pages: list[list[int]] = [[] for _ in range(num_slots)]
        self._free = list(range(num_pages))  # a heap: the lowest free id first keeps use compact

    @property
    def num_free(self) -> int:
        return len(self._free)

    def pages_of(self, slot: int) -> list[int]:
        """Slot's page ids in position order (a copy)."""
        return list(self._pages[slot])

    def num_held(self, slot: int) -> int:
        return len(self._pages[slot])

    def grow(self, slot: int, count: int) -> bool:
        """Give ``slot`` free pages until it holds ``count``; False (and nothing taken) when
        too few are free."""
        pages = self._pages[slot]
        need = count - len(pages)
        if need > len(self._free):
            return False
        if need > 0:
            new = [heapq.heappop(self._free) for _ in range(need)]
            self.table[slot, len(pages):count] = torch.tensor(new, device=self.table.device)
            pages += new
        return True

    def release(self, slot: int) -> None:
        """Return all of ``slot``'s pages to the free pool."""
        for page in self._pages[slot]:
            heapq.heappush(self._free, page)
        self._pages[slot] = []

    def add_pages(self, count: int) -> None:
        """Extend the pool by ``count`` free pages (ids num_pages...): the storage grew."""
        for page in range(self.num_pages, self.num_pages + count):
            heapq.heappush(self._free, page)
        self.num_pages += count
