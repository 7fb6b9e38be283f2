"""Continuous-batching scheduler: plain Python queues, pages and budgets (no torch).

A request's life:
  1. `add` puts it in the waiting queue.
  2. `schedule` admits it when the token budget, the running cap and free pages allow; its prompt is
     prefilled in chunks of at most `chunked_prefill_size` tokens, one chunk per step.
  3. Every step processes tokens all_ids[num_computed : num_computed + n]; when that reaches the end of
     the sequence the step samples one new token (a decode step is simply n == 1). With speculative
     decoding a decode step instead reserves `decode_width` scratch slots (root + draft nodes) from
     num_computed; `commit` then advances num_computed past the accepted path and frees whole
     surplus pages (rollback is a length change).
  4. When pages run out for running requests, the newest running request is preempted: its pages are
     freed and it returns to the front of the waiting queue to be recomputed (outputs kept). A pinned
     request (`pin`: PD prefill whose pages are being streamed to D) holds pages for its whole prompt and
     is never preempted.
  5. `finish` (stop / length / abort) frees its pages; the pool's free count returns to its start.
Prefix cache (`cache`, specpd/kv/radix.py): at admission a request takes the longest cached prefix of its
tokens (whole pages, never its last token: the step that samples must run) and computes from there; when it
finishes or is preempted its full valid pages go into the cache instead of the free list (positions below
`num_computed_tokens`; where the pages carry draft KV, below `draft_kv_len`, or, with `draft_cache`, with the target
features the draft's KV is built from where it lags: SpecRunner.cache_payloads / adopt_cached). Then the invariant
is free + evictable == total, and the allocator evicts unreferenced cached pages when it runs short.
"""
from __future__ import annotations

from collections import deque
from specpd.config import SchedulerConfig
from specpd.core import Request, RequestStatus, ScheduledBatch, ScheduledItem
from specpd.kv.allocator import PageAllocator, pages_needed
from specpd.kv.radix import RadixCache


class Scheduler:
    def __init__(self, config: SchedulerConfig, allocator: PageAllocator, page_size: int, decode_width: int = 1,
                 cache: RadixCache | None = None, draft_cache=None, page_payloads=None):
        """draft_cache: where cached pages carry draft KV that may lag the target's (adaptive speculation defers
        the draft's extends), the spec runner, whose `cache_payloads` / `adopt_cached` keep the features for the
        lagging part. page_payloads: where every cached page carries a payload, (request, num_pages) -> one
        payload per page, or None (then nothing is cached)."""
        self.config = config
        self.decode_width = decode_width
        self.allocator = allocator
        self.page_size = page_size
        self.cache = cache
        self.page_payloads = page_payloads
        self.draft_cache = draft_cache
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self._unfinished: dict[str, Request] = {}  # request id -> request, waiting or running

    # -- queue management ------------------------------------------------------------------
    def add(self, request: Request) -> None:
        self.waiting.append(request)
        self._unfinished[request.request_id] = request

    def add_running(self, request: Request) -> None:
        """A request whose prompt KV is already in its pages (PD decode: committed handoff)."""
        request.status = RequestStatus.RUNNING
        self.running.append(request)
        self._unfinished[request.request_id] = request

    def detach(self, request: Request) -> None:
        """Take a request out of the queues keeping its pages (PD prefill: held until the KV is sent)."""
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        self._unfinished.pop(request.request_id, None)
        request.status = RequestStatus.FINISHED

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def find(self, request_id: str) -> Request | None:
        return self._unfinished.get(request_id)

    def finish(self, request: Request, reason: str) -> None:
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        self._release(request)
        self._unfinished.pop(request.request_id, None)
        request.status = RequestStatus.FINISHED
        request.finish_reason = reason

    def _release(self, request: Request) -> None:
        self.release_pages(request)
        request.num_computed_tokens = 0
        request.cached_draft = None
        if request.draft_kv_len is not None:
            request.draft_kv_len = 0

    def release_pages(self, request: Request, payloads: list | None = None) -> None:
        """Give back a request's pages: its full valid pages to the prefix cache (if any), the rest freed.
        `payloads`: one per page, kept with the cached page (PD prefill, decode-only: target features)."""
        cache = self.cache
        if cache is None:
            if request.pages:
                self.allocator.free(request.pages)
        else:
            valid = request.num_computed_tokens
            if request.draft_kv_len is not None:
                if self.draft_cache is not None and payloads is None:
                    valid, payloads = self.draft_cache.cache_payloads(request, valid)
                else:
                    valid = min(valid, request.draft_kv_len)
            if payloads is None and self.page_payloads is not None and request.pages:
                payloads = self.page_payloads(request, valid // self.page_size)
                if payloads is None:
                    valid = 0  # pages without the payload every cached page must carry: not cached
            if request.cache_node is not None:  # the pages it matched are valid and stay the cache's
                valid = max(valid, request.cache_node.depth * self.page_size)
            rest = cache.insert(request.all_token_ids, request.pages, valid, payloads) if request.pages else []
            cache.unlock(request.cache_node)
            request.cache_node = None
            if rest:
                self.allocator.free(rest)
        request.pages = []

    def _match_prefix(self, request: Request) -> None:
        """A waiting request with no KV takes the longest cached prefix (locked until its pages go back)."""
        if self.cache is None or request.pages or request.cache_node is not None:
            return
        tokens = request.all_token_ids
        m = self.cache.match(tokens, max_tokens=len(tokens) - 1)
        if not m.pages or (self.page_payloads is not None and any(p is None for p in m.payloads)):
            return
        if request.draft_kv_len is not None and self.draft_cache is not None:
            m = m.cut(self.draft_cache.adopt_cached(request, m.payloads))  # pages lacking draft KV only at the end
        self.cache.lock(m.node)
        request.cache_node = m.node
        request.pages = list(m.pages)
        request.num_computed_tokens = m.num_pages * self.page_size
        if request.draft_kv_len is not None and self.draft_cache is None:
            request.draft_kv_len = request.num_computed_tokens
        if not request.output_token_ids:
            request.num_cached_tokens = request.num_computed_tokens
        request.handoff_hidden = list(m.payloads) if self.page_payloads is not None else None

    def _leader_ready(self, request: Request) -> bool:
        """A parallel sample waits until its leader has computed the prompt (then shares its pages); one whose
        leader finished or was preempted finds the pages in the cache, where the leader's release put them."""
        leader = request.prefix_leader
        if leader is None:
            return True
        if not leader.finished and not leader.output_token_ids:
            return False
        if leader.status is RequestStatus.RUNNING:
            self.share_prefix(leader)
        request.prefix_leader = None
        return True

    def share_prefix(self, request: Request) -> None:
        """Put a running request's computed prompt pages in the prefix cache now, not when it ends, locked for it
        (its `cache_node`): the parallel samples of its request match them. Pages whose draft KV lags stay out."""
        if self.cache is None or not request.pages or self.page_payloads is not None:
            return
        valid = min(request.num_computed_tokens, request.num_prompt_tokens)
        if request.draft_kv_len is not None:
            valid = min(valid, request.draft_kv_len)
        tokens = request.all_token_ids
        self.cache.insert(tokens, request.pages, valid)  # pages it did not adopt stay the request's, as they are
        m = self.cache.match(tokens, max_tokens=valid, count=False)
        own = next((k for k, page in enumerate(m.pages) if page != request.pages[k]), m.num_pages)
        m = m.cut(own)  # past a page another request cached first, the path is not this request's pages
        held = request.cache_node.depth if request.cache_node is not None else 0
        if m.num_pages <= held:
            return
        self.cache.lock(m.node)
        self.cache.unlock(request.cache_node)
        request.cache_node = m.node

    # -- scheduling ------------------------------------------------------------------------
    def _grow(self, request: Request, end: int) -> bool:
        """Make sure `request` owns pages for positions < end."""
        extra = pages_needed(end, self.page_size) - len(request.pages)
        if extra <= 0:
            return True
        if not self.allocator.can_alloc(extra):
            return False
        request.pages.extend(self.allocator.alloc(extra))
        return True

    def pin(self, request: Request) -> bool:
        """Give a running prefill-only `request` the pages of its whole prompt now, and never preempt it
        (PD prefill: writes to D read its pages while it prefills, so it must never wait for pages it
        cannot get); False if the pool is short."""
        if not self._grow(request, request.num_tokens):
            return False
        request.kv_pinned = True
        return True

    def _preempt_newest(self, batch: ScheduledBatch, keep: Request) -> bool:
        victims = [r for r in self.running if r is not keep and not r.kv_pinned
                   and all(it.request is not r for it in batch.items)]
        if not victims:
            return False
        victim = max(victims, key=lambda r: r.seq_no)
        self.running.remove(victim)
        self._release(victim)
        victim.status = RequestStatus.WAITING
        self.waiting.appendleft(victim)
        batch.preempted.append(victim)
        return True

    def schedule(self) -> ScheduledBatch:
        cfg = self.config
        batch = ScheduledBatch()
        budget = cfg.max_num_batched_tokens
        # running requests first (decodes and unfinished prefill chunks), oldest first
        for req in sorted(self.running, key=lambda r: r.seq_no):
            if budget <= 0:
                break
            if req not in self.running:  # preempted below by an older request
                continue
            # a prompt whose last chunk is one token still prefills it (y0 and the first draft state come from it)
            spec = (self.decode_width > 1 and bool(req.output_token_ids)
                    and req.num_computed_tokens == req.num_tokens - 1)
            n = self.decode_width if spec else min(req.num_tokens - req.num_computed_tokens, budget,
                                                   cfg.chunked_prefill_size)
            while not self._grow(req, req.num_computed_tokens + n):
                if not self._preempt_newest(batch, keep=req):
                    break
            else:
                batch.items.append(ScheduledItem(req, req.num_computed_tokens, n, spec_decode=spec))
                budget -= n
                continue
            # could not get pages even after preempting everyone else: recompute this one later
            self.running.remove(req)
            self._release(req)
            req.status = RequestStatus.WAITING
            self.waiting.appendleft(req)
            batch.preempted.append(req)
        # then admit waiting requests
        while self.waiting and budget > 0 and len(self.running) < cfg.max_running_requests:
            req = self.waiting[0]
            if not self._leader_ready(req):
                break
            self._match_prefix(req)
            n = min(req.num_tokens - req.num_computed_tokens, budget, cfg.chunked_prefill_size)
            if not self._grow(req, req.num_computed_tokens + n):
                self._release(req)  # a request that waits holds nothing: its matched pages stay evictable
                break
            self.waiting.popleft()
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            batch.items.append(ScheduledItem(req, req.num_computed_tokens, n))
            budget -= n
        return batch

    def commit(self, item: ScheduledItem, num_committed_slots: int) -> None:
        """Record that positions < start + num_committed_slots now hold valid KV; slots past them are
        scratch, and pages no longer needed for the next token are released."""
        req = item.request
        req.num_computed_tokens = item.start + num_committed_slots
        keep = pages_needed(req.num_computed_tokens + 1, self.page_size)
        if len(req.pages) > keep and not req.kv_pinned:  # a pinned prefill holds its whole prompt's pages
            self.allocator.free(req.pages[keep:])
            del req.pages[keep:]
