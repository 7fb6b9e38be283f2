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
     freed and it returns to the front of the waiting queue to be recomputed (outputs kept).
  5. `finish` (stop / length / abort) frees its pages; the pool's free count returns to its start.
"""
from __future__ import annotations

from collections import deque
from specpd.config import SchedulerConfig
from specpd.core import Request, RequestStatus, ScheduledBatch, ScheduledItem
from specpd.kv.allocator import PageAllocator, pages_needed


class Scheduler:
    def __init__(self, config: SchedulerConfig, allocator: PageAllocator, page_size: int, decode_width: int = 1):
        self.config = config
        self.decode_width = decode_width
        self.allocator = allocator
        self.page_size = page_size
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
        if request.pages:
            self.allocator.free(request.pages)
            request.pages = []
        request.num_computed_tokens = 0

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

    def _preempt_newest(self, batch: ScheduledBatch, keep: Request) -> bool:
        victims = [r for r in self.running if r is not keep and all(it.request is not r for it in batch.items)]
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
            spec = self.decode_width > 1 and req.num_computed_tokens == req.num_tokens - 1
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
            n = min(req.num_tokens - req.num_computed_tokens, budget, cfg.chunked_prefill_size)
            if not self._grow(req, req.num_computed_tokens + n):
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
        if len(req.pages) > keep:
            self.allocator.free(req.pages[keep:])
            del req.pages[keep:]
