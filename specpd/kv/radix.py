"""Prefix cache: a radix tree over token ids at page granularity, holding ref-counted KV pages (no torch).

Every edge is one full page: its key is the page's `page_size` token ids, plus the `lookahead` token after
the page when the pages also carry draft KV. A draft's KV at position p was built from token x_{p+1}, so a
page's last draft slot is valid only for a request whose token after the page is the one it was built with;
with the lookahead in the key a matched page is valid for the target and the draft alike and nothing is
recomputed (siblings may share a page's tokens and differ in the lookahead: they hold different pages).

Lifecycle of a page:
  1. A request allocates it from the PageAllocator and computes its KV.
  2. When the request finishes or is preempted, `insert` adopts its full pages whose KV is valid (pages the
     tree already holds for the same key are returned to the caller to free).
  3. A new request's `match` walks the tree and `lock`s the path: a locked node is never evicted.
     Its pages become the head of the request's page list; it computes only the rest.
  4. `unlock` when the request lets go; unreferenced leaves are evicted least-recently-used first when the
     allocator runs short (`PageAllocator.reclaimer`) or on `flush`.
Invariant: allocator free + evictable == total pages once no request runs; `flush` returns free to total.

A node may carry an opaque `payload` per page (a PD prefill server in draft-on-decode-only mode keeps the
page's target features there: D's draft needs them for every position, cached or not; a speculating engine keeps
the features of a page whose draft KV was never built, and None where it was: `insert` clears a node's payload
when a request offers None for the very page it holds, its draft having caught up over it).
"""
from __future__ import annotations

import heapq
import itertools
from dataclasses import dataclass, field
from typing import Any

from specpd.kv.allocator import PageAllocator


@dataclass(eq=False)
class RadixNode:
    key: tuple[int, ...]  # the page's tokens (+ the lookahead token)
    page: int
    parent: "RadixNode | None"
    depth: int  # pages from the root, this one included
    children: dict[tuple[int, ...], "RadixNode"] = field(default_factory=dict)
    ref: int = 0  # requests holding this node (a lock holds every node on its path)
    last_use: int = 0
    payload: Any = None


@dataclass
class PrefixMatch:
    node: RadixNode | None  # the deepest matched node (None: nothing matched); lock / unlock this
    pages: list[int]
    payloads: list[Any]

    @property
    def num_pages(self) -> int:
        return len(self.pages)

    def cut(self, num_pages: int) -> "PrefixMatch":
        """The match's first `num_pages` pages (its node walked up to that depth)."""
        if num_pages >= len(self.pages):
            return self
        node = self.node
        while node is not None and node.depth > num_pages:
            node = node.parent
        return PrefixMatch(node if num_pages else None, self.pages[:num_pages], self.payloads[:num_pages])

    def draft_built(self) -> "PrefixMatch":
        """The pages before the first whose payload holds the features of draft KV never built (a speculating
        engine's cache, specpd/spec/defer.py): what a reader without them may take as draft KV."""
        return self.cut(next((k for k, p in enumerate(self.payloads) if p is not None), len(self.pages)))


class RadixCache:
    def __init__(self, allocator: PageAllocator, page_size: int, lookahead: int = 0):
        if lookahead not in (0, 1):
            raise ValueError(f"lookahead must be 0 or 1, got {lookahead}")
        self.allocator = allocator
        self.page_size = page_size
        self.lookahead = lookahead
        self.root = RadixNode((), -1, None, 0)
        self.root.ref = 1  # never evicted
        self._clock = itertools.count(1)
        self.num_cached = 0  # pages in the tree
        self.num_evictable = 0  # pages in the tree no request holds
        self.hit_tokens = 0
        self.query_tokens = 0
        allocator.reclaimer = self

    # -- keys ------------------------------------------------------------------------------
    def _key(self, tokens: list[int], k: int) -> tuple[int, ...] | None:
        """Page k's key, or None when the tokens do not cover it (and its lookahead)."""
        ps = self.page_size
        end = (k + 1) * ps + self.lookahead
        return tuple(tokens[k * ps:end]) if end <= len(tokens) else None

    # -- lookups ---------------------------------------------------------------------------
    def match(self, tokens: list[int], max_tokens: int | None = None, count: bool = True) -> PrefixMatch:
        """Longest cached prefix of `tokens` in whole pages, covering at most `max_tokens` tokens (the caller
        keeps at least the last prompt token to compute). Does not lock; counts hit and query tokens (`count`)."""
        limit = len(tokens) if max_tokens is None else min(max_tokens, len(tokens))
        node, pages, payloads = self.root, [], []
        now = next(self._clock)
        for k in range(limit // self.page_size):
            key = self._key(tokens, k)
            child = node.children.get(key) if key is not None else None
            if child is None:
                break
            child.last_use = now
            node = child
            pages.append(child.page)
            payloads.append(child.payload)
        if count:
            self.count_lookup(len(tokens), len(pages) * self.page_size)
        return PrefixMatch(node if pages else None, pages, payloads)

    def count_lookup(self, query_tokens: int, hit_tokens: int) -> None:
        """Count a lookup made with `match(count=False)` once its caller knows it will use it."""
        self.query_tokens += query_tokens
        self.hit_tokens += hit_tokens

    def lock(self, node: RadixNode | None) -> None:
        while node is not None and node is not self.root:
            if node.ref == 0:
                self.num_evictable -= 1
            node.ref += 1
            node = node.parent

    def unlock(self, node: RadixNode | None) -> None:
        while node is not None and node is not self.root:
            if node.ref <= 0:
                raise ValueError(f"unlock of an unreferenced cache node (page {node.page})")
            node.ref -= 1
            if node.ref == 0:
                self.num_evictable += 1
            node = node.parent

    # -- insertion -------------------------------------------------------------------------
    def insert(self, tokens: list[int], pages: list[int], num_valid: int,
               payloads: list[Any] | None = None) -> list[int]:
        """Offer a request's pages: page k holds positions [k*ps, (k+1)*ps) of `tokens`, valid below
        `num_valid`. Adopts every full valid page whose key is new; returns the pages the caller still owns
        (duplicates of cached pages, partial or invalid pages) — to free, except those it had matched."""
        ps = self.page_size
        node = self.root
        now = next(self._clock)
        rest: list[int] = []
        k = 0
        n_full = min(len(pages), num_valid // ps)
        while k < n_full:
            key = self._key(tokens, k)
            if key is None:
                break
            offered = payloads is not None and k < len(payloads)  # (none offered past the list: a matched page)
            child = node.children.get(key)
            if child is None:
                child = RadixNode(key, pages[k], node, node.depth + 1, payload=payloads[k] if offered else None)
                node.children[key] = child
                self.num_cached += 1
                self.num_evictable += 1
            elif child.page != pages[k]:
                rest.append(pages[k])
            elif offered and payloads[k] is None:
                child.payload = None
            child.last_use = now
            node = child
            k += 1
        rest.extend(pages[k:])
        return rest

    # -- eviction --------------------------------------------------------------------------
    def evict(self, num_pages: int) -> int:
        """Free up to `num_pages` pages from unreferenced leaves, least recently used first."""
        freed: list[int] = []
        heap = [(n.last_use, id(n), n) for n in self._nodes() if not n.children and n.ref == 0]
        heapq.heapify(heap)
        while heap and len(freed) < num_pages:
            _, _, node = heapq.heappop(heap)
            parent = node.parent
            del parent.children[node.key]
            freed.append(node.page)
            self.num_cached -= 1
            self.num_evictable -= 1
            if parent is not self.root and not parent.children and parent.ref == 0:
                heapq.heappush(heap, (parent.last_use, id(parent), parent))
        if freed:
            self.allocator.free(freed)
        return len(freed)

    def flush(self) -> int:
        """Drop every unreferenced cached page; returns how many."""
        return self.evict(self.num_cached)

    def _nodes(self):
        stack = list(self.root.children.values())
        while stack:
            n = stack.pop()
            yield n
            stack.extend(n.children.values())

    def stats(self) -> dict:
        return {"cached_pages": self.num_cached, "evictable_pages": self.num_evictable,
                "prefix_cache_hit_tokens": self.hit_tokens, "prefix_cache_query_tokens": self.query_tokens}
