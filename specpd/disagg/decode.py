"""The decode server (D): reserve pages, receive P's prompt KV and handoff, then decode as usual.

A request's life on D, keyed by its `bootstrap_room`:
  0. bootstrap (HTTP handler, before submit): `GET /route` on P's bootstrap server gives P's control endpoint
     and PeerConfig (transfer backend included); `check_compatible` refuses a mismatched P with HTTP 400 naming
     both values (an unreachable bootstrap server: HTTP 502). The route is cached per P while P answers;
     one not heard for ROUTE_TRUST_S, found gone, or whose connection dropped (the process exited) is asked
     again, so a restarted P's new control port is found however soon it is back (and the old one forgotten).
  1. prealloc queue: `DecodeRegister` goes to P over a DEALER socket (one per P) as the request is admitted
     (P now knows the room is claimed, and D's heartbeats tell it D is alive); pages for positions 0..N-1 are
     reserved from the engine's allocator (waits while the pool is short); then `KVDestination` (transfer
     session, pool layouts, page ids) goes to P.
  2. transfer queue: D polls its sockets; the room is ready once it holds both P's `HandoffRecord` and
     `TransferDone` (P's writes into the reserved pages completed). `TransferFailed` fails the request and
     frees the pages (P sends it only when no write is in flight).
  3. commit: `engine.add_prebuilt_request` puts the request in the running batch with num_computed = N and
     output [y0] (stop checks apply to y0; the seeded generator continues from P's state) and, draft-on-both,
     P's DraftState (the draft KV came in the draft pool's pages). No target forward.
  3b. draft-on-decode-only: the same call runs the draft extend over the prompt from P's target features
     (the colocated engine's extend after prefill), which writes the draft KV and the first-round proposal.
  4. running: the engine's normal decode steps; the first writes y0's KV at position N.
Abort (client gone): a room still in the prealloc queue is dropped (`Abort` tells P, which holds only its
registration); in the transfer queue D sends `Abort` and keeps the pages until P's TransferDone /
TransferFailed / AbortAck says nothing is in flight, or until `abort_timeout_s` passed with no answer (P is
dead; a frozen P could still write into pages D would reuse).
When D stops waiting for P (decode_watch.py; the client gets an error at once, then the pages follow the abort
rule above): waiting for prefill (`prefill_timeout_s`, KVDestination sent -> HandoffRecord) or for the transfer
(`transfer_timeout_s`, HandoffRecord -> TransferDone) with no progress of the room or its P for that long;
a P silent for `heartbeat_timeout_s`; a P whose connection dropped and whose bootstrap port refuses or names
another endpoint (gone: the pages are freed at once). Heartbeat: D's control thread (`DecodeControl`,
control.py) pings every P that holds rooms of D's each HEARTBEAT_INTERVAL_S and stamps every message from P on
its own clock, so D's own long engine step never reads as P's silence; P's silence is counted from its oldest
unanswered ping to the control thread's last tick (`DecodeControl.silent_s`), so neither does a stall of D's
whole process. P's control thread answers with its load and progress: a busy P answers, and its rooms wait as
long as it makes progress.
"""
from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass, field

from specpd.core import InvalidRequest, SamplingParams, TokenLogprob
from specpd.disagg.bootstrap import BootstrapUnreachable, Route, fetch_route
from specpd.disagg.control import HEARTBEAT_INTERVAL_S, DecodeControl
from specpd.disagg.decode_watch import PrefillWatch
from specpd.disagg.messages import (Abort, AbortAck, ConfigMismatch, DecodeRegister, HandoffRecord, KVDestination,
                                    PeerConfig, TargetFeatures, TransferDone, TransferFailed, check_compatible)
from specpd.disagg.timeline import between, describe
from specpd.disagg.worker import BootstrapInfo, DisaggWorker
from specpd.spec.draft.proposer import DraftState
from specpd.kv.allocator import pages_needed

logger = logging.getLogger(__name__)

# a cached route to P is trusted this long after P last spoke (or was asked), while its connection holds (a P
# that exited dropped it: DecodeControl.lost); a P that owes rooms is heard at every heartbeat
ROUTE_TRUST_S = 2 * HEARTBEAT_INTERVAL_S


@dataclass(eq=False)  # a room is itself: compared by identity (prealloc_queue.remove)
class _Room:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    info: BootstrapInfo
    route: Route
    pages: list[int] = field(default_factory=list)
    cache_node: object = None  # the prefix-cache path the first pages come from (locked until commit / free)
    cached_tokens: int = 0  # positions < this are in D's cached pages: P sends nothing for them
    draft_streamed: int = 0  # decode-only: positions after cached_tokens D drafted from TargetFeatures
    draft_extends: list = field(default_factory=list)  # decode-only: seconds of each of those draft extends
    record: HandoffRecord | None = None
    done: TransferDone | None = None
    aborted_at: float | None = None  # monotonic time D sent Abort
    sent_at: float = 0.0  # monotonic time KVDestination went to P (the wait for P starts)
    record_at: float | None = None  # monotonic time the HandoffRecord arrived (the wait for the KV starts)
    heard_at: float = 0.0  # monotonic arrival of P's last message for the room (progress: decode_watch.py)
    error: str | None = None  # why D gave up on the room (reported once its pages are safe to free)
    marks: dict = field(default_factory=dict)  # stage boundary -> monotonic time (timeline.py)


# (stage, start mark, end mark): timeline.py's D stages
_D_STAGES = [("d_admit", "received", "queued"), ("d_prealloc", "queued", "offered"),
             ("d_wait_record", "offered", "record"), ("d_wait_kv", "record", "kv_done"),
             ("d_commit", "ready", "committed"), ("d_first_token_out", "committed", "first_token"),
             ("d_ttft", "received", "first_token")]


class DecodeWorker(PrefillWatch, DisaggWorker):
    role = "decode"

    def __init__(self, engine, transfer_backend: str, host: str = "127.0.0.1", abort_timeout_s: float = 30.0,
                 prefill_timeout_s: float = 300.0, transfer_timeout_s: float = 60.0,
                 heartbeat_timeout_s: float = 10.0, local_prefill_tokens: int = 128,
                 advertise_host: str | None = None):
        super().__init__(engine, transfer_backend, host, advertise_host)
        self.abort_timeout_s = abort_timeout_s
        self.prefill_timeout_s = prefill_timeout_s  # KVDestination sent -> HandoffRecord (P queued + prefilled)
        self.transfer_timeout_s = transfer_timeout_s  # HandoffRecord -> TransferDone (the KV writes)
        self.heartbeat_timeout_s = heartbeat_timeout_s  # P silent this long while it owes us rooms: dead
        # a prompt whose prefix D's cache holds up to at most this many tokens is prefilled here, not on P
        self.local_prefill_tokens = local_prefill_tokens
        self.local_prefills = 0
        self.draft_streamed_tokens = 0  # decode-only: prompt positions drafted from TargetFeatures before commit
        self._init_watch()
        self.name = f"decode@{host}:{os.getpid()}"
        # P's bootstrap address -> (route, monotonic fetch time); HTTP handler threads and the engine thread
        self._routes: dict[tuple[str, int], tuple[Route, float]] = {}
        self._routes_by_request: dict[str, Route] = {}
        self.prealloc_queue: list[_Room] = []
        self._committed: dict[str, _Room] = {}  # request id -> committed room whose y0 is not out yet
        self.transfer_queue: dict[int, _Room] = {}
        self.control = DecodeControl(self).start()

    # -- loop thread: bootstrap ------------------------------------------------------------
    def bootstrap(self, request_id: str, info: BootstrapInfo) -> None:
        """Find P and check it serves what we serve; raises InvalidRequest (-> 400) naming both values, or
        BootstrapUnreachable (-> 502) when P's bootstrap server does not answer."""
        key = (info.host, info.port)
        now = received_at = time.monotonic()
        with self._lock:
            route, fetched = self._routes.get(key, (None, 0.0))
        # trust a cached route only while its P was heard (or asked) within ROUTE_TRUST_S and its connection
        # has not dropped since: a P killed and restarted (a new control endpoint) closed it when it exited, so
        # it is asked again however soon it is back and however recently it spoke
        if (route is None or route.zmq_endpoint in self.control.lost
                or now - max(fetched, self.control.heard.get(route.zmq_endpoint, 0.0)) > ROUTE_TRUST_S):
            stale = route
            try:
                route = fetch_route(info.host, info.port)
            except OSError as e:
                raise BootstrapUnreachable(f"prefill bootstrap server {info.host}:{info.port} "
                                           f"unreachable: {e}") from None
            with self._lock:
                self._routes[key] = (route, now)
            if stale is not None and stale.zmq_endpoint != route.zmq_endpoint:
                self.replaced(stale.zmq_endpoint)  # a new P there: the old one is forgotten once it holds no room
        try:
            check_compatible(PeerConfig(**route.config), self.peer_config)
        except (ConfigMismatch, TypeError) as e:
            raise InvalidRequest("bootstrap_host", str(e)) from None
        with self._lock:
            self._routes_by_request[request_id] = route
        self.expect(request_id, info, received_at)

    # -- engine interface ------------------------------------------------------------------
    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams):
        info, received_at = self._take_expected(request_id)
        with self._lock:
            route = self._routes_by_request.pop(request_id)
        self.engine.validate_request(request_id, prompt_token_ids, params)
        if any(r.info.room == info.room for r in self.prealloc_queue) or info.room in self.transfer_queue:
            raise InvalidRequest("bootstrap_room", f"room {info.room} is already in use on this decode server")
        self._send(route.zmq_endpoint, DecodeRegister(info.room, "", self.peer_config))  # stage 1: claimed
        self.prealloc_queue.append(_Room(request_id, list(prompt_token_ids), params, info, route,
                                         marks={"received": received_at, "queued": time.monotonic()}))

    def abort_request(self, request_id: str) -> None:
        for room in self.prealloc_queue:
            if room.request_id == request_id:
                self.prealloc_queue.remove(room)
                self._abort_registered(room, "client gone")
                self._final(request_id, len(room.prompt_token_ids), "abort")
                return
        for room in self.transfer_queue.values():
            if room.request_id == request_id and room.aborted_at is None:
                room.aborted_at = time.monotonic()
                self._send(room.route.zmq_endpoint, Abort(room.info.room, "client gone"))
                return
        self.engine.abort_request(request_id)

    def disagg_busy(self) -> bool:
        return bool(self.prealloc_queue or self.transfer_queue)

    def queue_sizes(self) -> dict:
        return {"pd_prealloc": len(self.prealloc_queue), "pd_transfer": len(self.transfer_queue)}

    def stats(self) -> dict:
        return {**super().stats(), "pd_heartbeat_rtt_ms": self.control.rtt_ms(),
                "pd_local_prefills": self.local_prefills, "pd_draft_streamed_tokens": self.draft_streamed_tokens,
                "pd_prefill_load": {e: hb.load for e, hb in list(self.control.load.items())}}

    # -- stages ----------------------------------------------------------------------------
    def _send(self, endpoint: str, msg) -> None:
        self.control.send(endpoint.encode(), msg)

    def on_message(self, endpoint: str, msg, arrived_at: float) -> None:
        room = self.transfer_queue.get(getattr(msg, "room", None))
        waiting = None if room is not None else next(
            (r for r in self.prealloc_queue if r.info.room == getattr(msg, "room", None)), None)
        if waiting is not None and isinstance(msg, TransferFailed):  # P refused the registration: no pages yet
            self.prealloc_queue.remove(waiting)
            self._final(waiting.request_id, len(waiting.prompt_token_ids), "abort",
                        error=f"prefill server failed the handoff: {msg.reason}")
            return
        if room is None:  # an AbortAck after P's TransferFailed already closed the room is expected
            level = logging.DEBUG if isinstance(msg, AbortAck) else logging.WARNING
            logger.log(level, "%s for unknown room %s", type(msg).__name__, getattr(msg, "room", None))
            return
        room.heard_at = arrived_at
        if isinstance(msg, HandoffRecord):
            room.record = msg
            room.record_at = room.marks["record"] = arrived_at
        elif isinstance(msg, TargetFeatures):
            self._extend_draft(room, msg)
        elif isinstance(msg, TransferDone):
            room.done = msg
            room.marks["kv_done"] = arrived_at
        elif isinstance(msg, (TransferFailed, AbortAck)):  # P has no write in flight into the room's pages
            del self.transfer_queue[room.info.room]
            self._free_pages(room)
            if room.aborted_at is None:
                self._final(room.request_id, len(room.prompt_token_ids), "abort",
                            error=f"prefill server failed the handoff: {msg.reason}")
            elif room.error is None:  # a client abort: its final output is still owed
                self._final(room.request_id, len(room.prompt_token_ids), "abort")

    def _extend_draft(self, room: _Room, msg: TargetFeatures) -> None:
        """Decode-only, a prefill chunk's target features: the draft extend over them now, into the room's pages
        (P writes only target KV there), while P computes the next chunk. Out of order, it is skipped and the
        commit refuses the record (its hidden_start is not where D's draft KV ends)."""
        start = room.cached_tokens + room.draft_streamed
        if msg.start != start or room.aborted_at is not None:
            logger.warning("room %d: target features from %d, D's draft KV ends at %d", msg.room, msg.start, start)
            return
        t0 = time.monotonic()
        try:
            self.engine.draft_extend_prompt_part(room.prompt_token_ids, room.pages, msg.start, msg.hidden)
        except ValueError as e:
            logger.warning("room %d: %s", msg.room, e)
            return
        room.draft_extends.append(time.monotonic() - t0)
        room.draft_streamed += msg.hidden.shape[0]
        self.draft_streamed_tokens += msg.hidden.shape[0]

    def _give_up(self, room: _Room, error: str | None, reason: str) -> None:
        """Stop waiting for `room`: the client hears now (error), the pages stay until P confirms."""
        if room.aborted_at is not None:
            return
        room.aborted_at = time.monotonic()
        room.error = error
        if error is not None:
            logger.warning("room %d: %s", room.info.room, error)
            self._final(room.request_id, len(room.prompt_token_ids), "abort", error=error)
        self._send(room.route.zmq_endpoint, Abort(room.info.room, reason))

    def advance(self) -> None:
        allocator = self.engine.scheduler.allocator
        page_size = self.peer_config.page_size
        cache = self.engine.prefix_cache
        while self.prealloc_queue:
            room = self.prealloc_queue[0]
            n = len(room.prompt_token_ids)
            match = cache.match(room.prompt_token_ids, max_tokens=n - 1, count=False) if cache is not None else None
            if match is not None and self.engine.scheduler.draft_cache is not None:
                match = match.draft_built()  # the handoff takes a cached page's draft KV as built (the settle's
                # successor keeps a page's features instead where it was not: SpecRunner.cache_payloads)
            cached = match.num_pages * page_size if match is not None else 0
            local = cached > 0 and n - cached <= self.local_prefill_tokens
            need = 0 if local else pages_needed(n, page_size) - (match.num_pages if match is not None else 0)
            if cached and not local:
                cache.lock(match.node)  # before allocating: an eviction must not take the matched pages
            if not allocator.can_alloc(need):
                if cached and not local:
                    cache.unlock(match.node)
                break
            self.prealloc_queue.pop(0)
            endpoint = room.route.zmq_endpoint
            if local:  # D holds all but a short suffix: prefill it here, P drops the room
                self._send(endpoint, KVDestination(room.info.room, tuple(self.kv.endpoints), [],
                                                   cached_tokens=cached, prefill_locally=True))
                self.local_prefills += 1
                self.engine.add_request(room.request_id, room.prompt_token_ids, room.params)
                continue
            if cached:
                room.cache_node, room.cached_tokens = match.node, cached
            if cache is not None:  # a local prefill is counted by the engine's own match instead
                cache.count_lookup(n, cached)
            room.pages = (list(match.pages) if cached else []) + allocator.alloc(need)
            room.marks["offered"] = time.monotonic()  # before the send: P may start before this thread resumes
            self._send(endpoint, KVDestination(room.info.room, tuple(self.kv.endpoints),
                                               room.pages[cached // page_size:], cached_tokens=cached))
            self.transfer_queue[room.info.room] = room
            room.sent_at = time.monotonic()
        self._watch_prefill_servers(time.monotonic())
        for room_id, room in list(self.transfer_queue.items()):
            gave_up = room.aborted_at is not None and time.monotonic() - room.aborted_at > self.abort_timeout_s
            if (room.record is None or room.done is None) and not gave_up:
                continue
            del self.transfer_queue[room_id]
            if room.aborted_at is not None:
                self._free_pages(room)
                if room.error is None:  # a client abort: its final output is still owed
                    self._final(room.request_id, len(room.prompt_token_ids), "abort")
                continue
            rec = room.record
            lp = None
            if rec.handoff_logprob is not None:
                top = ([] if rec.top_logprob_ids is None
                       else list(zip(rec.top_logprob_ids.tolist(), rec.top_logprobs.tolist())))
                lp = TokenLogprob(rec.handoff_token, rec.handoff_logprob, top)
            draft_state = None
            if rec.draft_mode == "both":
                draft_state = DraftState(rec.draft_topk_ids.tolist(), rec.draft_topk_probs.tolist(), rec.draft_hidden)
            try:
                drafted = room.cached_tokens + room.draft_streamed
                if rec.target_hidden is not None and rec.hidden_start != drafted:
                    raise ValueError(f"target features from position {rec.hidden_start}, D's draft KV covers "
                                     f"{drafted} tokens ({room.cached_tokens} cached)")
                self.engine.add_prebuilt_request(room.request_id, room.prompt_token_ids, room.params, room.pages,
                                                 rec.handoff_token, lp, draft_state=draft_state,
                                                 target_hidden=rec.target_hidden, sampler_state=rec.sampler_state,
                                                 cache_node=room.cache_node, cached_tokens=room.cached_tokens,
                                                 draft_start=drafted)
            except ValueError as e:  # a record that does not fit this server: fail the request, keep serving
                self._free_pages(room)
                self._final(room.request_id, len(room.prompt_token_ids), "abort", error=f"bad handoff: {e}")
                continue
            room.marks["ready"] = max(room.marks["record"], room.marks["kv_done"])
            room.marks["committed"] = time.monotonic()
            with self._lock:
                self._committed[room.request_id] = room
                while len(self._committed) > 4096:  # a y0 whose stream was gone before it left: forget it
                    self._committed.pop(next(iter(self._committed)))

    def _free_pages(self, room: _Room) -> None:
        """A room that will not commit: its own pages back to the allocator, its cached prefix unlocked."""
        own = room.pages[room.cached_tokens // self.peer_config.page_size:]
        if own:
            self.engine.scheduler.allocator.free(own)
        if room.cache_node is not None:
            self.engine.prefix_cache.unlock(room.cache_node)
            room.cache_node = None
        room.pages = []

    def on_first_token(self, request_id: str, at: float) -> None:
        """The event loop handed the request's first token (y0) to its HTTP stream at `at` (monotonic):
        the room's stages are complete (timeline.py)."""
        with self._lock:
            room = self._committed.pop(request_id, None)
        if room is None:
            return
        room.marks["first_token"] = at
        durations = between(room.marks, _D_STAGES)
        if room.draft_extends:
            durations["d_draft_extend_chunk"] = room.draft_extends
        self.stages.observe(durations)
        if logger.isEnabledFor(logging.DEBUG):
            logger.debug("room %d %s (%d tokens): %s", room.info.room, request_id, len(room.prompt_token_ids),
                         describe(durations))

    def close(self) -> None:
        super().close()
