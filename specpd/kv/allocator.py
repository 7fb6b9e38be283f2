"""Page allocator: plain Python, no torch. A page holds `page_size` consecutive positions."""
from __future__ import annotations


class OutOfPages(RuntimeError):
    pass


class PageAllocator:
    def __init__(self, num_pages: int):
        if num_pages <= 0:
            raise ValueError(f"num_pages must be positive, got {num_pages}")
        self.num_pages = num_pages
        # LIFO keeps recently freed (cache-warm) pages in use
        self._free: list[int] = list(range(num_pages - 1, -1, -1))
        self._used: set[int] = set()
        # a prefix cache holding unreferenced pages (specpd.kv.radix): evicted from when the free list is short
        self.reclaimer = None

    @property
    def num_reclaimable(self) -> int:
        return self.reclaimer.num_evictable if self.reclaimer is not None else 0

    @property
    def num_available(self) -> int:
        """Free pages plus the cached pages no request holds (what an allocation can get)."""
        return len(self._free) + self.num_reclaimable

    @property
    def num_free(self) -> int:
        return len(self._free)

    def can_alloc(self, n: int) -> bool:
        return n <= self.num_available

    def alloc(self, n: int) -> list[int]:
        if n > len(self._free) and self.reclaimer is not None:
            self.reclaimer.evict(n - len(self._free))
        if n > len(self._free):
            raise OutOfPages(f"need {n} pages, {len(self._free)} free")
        pages = [self._free.pop() for _ in range(n)]
        self._used.update(pages)
        return pages

    def free(self, pages: list[int]) -> None:
        for p in pages:
            if p not in self._used:
                raise ValueError(f"double free or foreign page {p}")
            self._used.remove(p)
            self._free.append(p)


def pages_needed(num_tokens: int, page_size: int) -> int:
    return (num_tokens + page_size - 1) // page_size
