"""Page allocator for one decode rank's share of the paged latent cache, with reference counts.

A page is free when its count is zero. Requests take pages with `allocate`; `share` adds a reference (a prefix held by
two requests, or a page in flight to another worker) and `release` drops one. Pages are global cache indices:
rank r owns [base, base + num_pages).
"""

from __future__ import annotations

import math


class OutOfPages(RuntimeError):
    pass


class PageAllocator:
    def __init__(self, num_pages: int, page_size: int, base: int = 0):
        if num_pages < 1 or page_size < 1:
            raise ValueError("num_pages and page_size must be >= 1")
        self.num_pages, self.page_size, self.base = num_pages, page_size, base
        self._refs = [0] * num_pages
        self._free = list(range(num_pages - 1, -1, -1))  # a stack: recently freed pages are reused first

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_pages - len(self._free)

    def pages_for(self, tokens: int) -> int:
        return math.ceil(tokens / self.page_size)

    def allocate(self, n: int) -> list[int]:
        if n > len(self._free):
            raise OutOfPages(f"{n} pages wanted, {len(self._free)} free")
        out = [self._free.pop() for _ in range(n)]
        for p in out:
            self._refs[p] = 1
        return [self.base + p for p in out]

    def share(self, pages: list[int]) -> None:
        for p in pages:
            i = self._index(p)
            if self._refs[i] == 0:
                raise ValueError(f"page {p} is free; only held pages can be shared")
            self._refs[i] += 1

    def release(self, pages: list[int]) -> None:
        for p in pages:
            i = self._index(p)
            if self._refs[i] == 0:
                raise ValueError(f"page {p} released twice")
            self._refs[i] -= 1
            if self._refs[i] == 0:
                self._free.append(i)

    def refcount(self, page: int) -> int:
        return self._refs[self._index(page)]

    def _index(self, page: int) -> int:
        i = page - self.base
        if not 0 <= i < self.num_pages:
            raise ValueError(
                f"page {page} is not in this allocator's range [{self.base}, {self.base + self.num_pages})"
            )
        return i
