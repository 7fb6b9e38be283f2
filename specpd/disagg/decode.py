"""The decode server (D): reserve pages, receive P's prompt KV and handoff, then decode as usual.

A request's life on D, keyed by its `bootstrap_room`:
  0. bootstrap (HTTP handler, before submit): `GET /route` on P's bootstrap server (cached per P) gives P's
     control endpoint and PeerConfig; `check_compatible` refuses a mismatched P with HTTP 400 naming both values.
  1. prealloc queue: pages for positions 0..N-1 are reserved from the engine's allocator (waits while the
     pool is short); then `DecodeRegister` and `KVDestination` (transfer session, pool layouts, page ids) go
     to P over a DEALER socket (one per P).
  2. transfer queue: D polls its sockets; the room is ready once it holds both P's `HandoffRecord` and
     `TransferDone` (P's writes into the reserved pages completed). `TransferFailed` fails the request and
     frees the pages (P sends it only when no write is in flight).
  3. commit: `engine.add_prebuilt_request` puts the request in the running batch with num_computed = N and
     output [y0] (stop checks apply to y0; the seeded generator continues from P's state) and, draft-on-both,
     P's DraftState (the draft KV came in the draft pool's pages). No target forward.
  3b. draft-on-decode-only: the same call runs the draft extend over the prompt from P's target features
     (the colocated engine's extend after prefill), which writes the draft KV and the first-round proposal.
  4. running: the engine's normal decode steps; the first writes y0's KV at position N.
Abort (client gone): a room still in the prealloc queue is dropped; in the transfer queue D sends `Abort`
and keeps the pages until P's TransferDone / TransferFailed / AbortAck says nothing is in flight, or until
`abort_timeout_s` passed with no answer (P is dead; a frozen P could still write: DESIGN.md §6).
Timeouts (the client gets an error at once, then the pages follow the abort rule above): waiting for
prefill (`prefill_timeout_s`, KVDestination sent -> HandoffRecord) and waiting for the transfer
(`transfer_timeout_s`, HandoffRecord -> TransferDone). Heartbeat: D pings every P that owes it rooms each
HEARTBEAT_INTERVAL_S; P answers. A P silent for `heartbeat_timeout_s` fails its rooms; if its bootstrap port
refuses connections the process is gone and the rooms' pages are freed at once.
"""
from __future__ import annotations

import logging
import os
import socket
import time
from dataclasses import dataclass, field

import zmq

from specpd.core import InvalidRequest, SamplingParams, TokenLogprob
from specpd.disagg.bootstrap import Route, fetch_route
from specpd.disagg.messages import (Abort, AbortAck, ConfigMismatch, DecodeRegister, HandoffRecord, Heartbeat,
                                    KVDestination, MessageError, PeerConfig, TransferDone, TransferFailed,
                                    check_compatible, recv_message, send_message)
from specpd.disagg.worker import BootstrapInfo, DisaggWorker
from specpd.draft.proposer import DraftState
from specpd.kv.allocator import pages_needed

logger = logging.getLogger(__name__)

HEARTBEAT_INTERVAL_S = 1.0  # D -> P while P owes D rooms; P answers each


def _reachable(info: BootstrapInfo, timeout_s: float = 1.0) -> bool:
    """Does P's bootstrap server still accept connections? Refused: the process is gone."""
    try:
        with socket.create_connection((info.host, info.port), timeout=timeout_s):
            return True
    except ConnectionRefusedError:
        return False
    except OSError:  # a timeout: alive but frozen, or the network: assume it could still write
        return True


@dataclass
class _Room:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    info: BootstrapInfo
    route: Route
    pages: list[int] = field(default_factory=list)
    record: HandoffRecord | None = None
    done: TransferDone | None = None
    aborted_at: float | None = None  # monotonic time D sent Abort
    sent_at: float = 0.0  # monotonic time KVDestination went to P (the wait for P starts)
    record_at: float | None = None  # monotonic time the HandoffRecord arrived (the wait for the KV starts)
    error: str | None = None  # why D gave up on the room (reported once its pages are safe to free)


class DecodeWorker(DisaggWorker):
    role = "decode"

    def __init__(self, engine, transfer_backend: str, host: str = "127.0.0.1", abort_timeout_s: float = 30.0,
                 prefill_timeout_s: float = 300.0, transfer_timeout_s: float = 60.0,
                 heartbeat_timeout_s: float = 10.0):
        super().__init__(engine, transfer_backend, host)
        self.abort_timeout_s = abort_timeout_s
        self.prefill_timeout_s = prefill_timeout_s  # KVDestination sent -> HandoffRecord (P queued + prefilled)
        self.transfer_timeout_s = transfer_timeout_s  # HandoffRecord -> TransferDone (the KV writes)
        self.heartbeat_timeout_s = heartbeat_timeout_s  # P silent this long while it owes us rooms: dead
        self._heard: dict[str, float] = {}  # P's control endpoint -> monotonic time of its last message
        self._pinged: dict[str, float] = {}  # P's control endpoint -> last Heartbeat we sent
        self._hb_seq = 0
        self.name = f"decode@{host}:{os.getpid()}"
        self._routes: dict[tuple[str, int], Route] = {}  # P's bootstrap address -> route (loop thread)
        self._sockets: dict[str, zmq.Socket] = {}  # P's control endpoint -> DEALER (engine thread)
        self._routes_by_request: dict[str, Route] = {}
        self.prealloc_queue: list[_Room] = []
        self.transfer_queue: dict[int, _Room] = {}

    # -- loop thread: bootstrap ------------------------------------------------------------
    def bootstrap(self, request_id: str, info: BootstrapInfo) -> None:
        """Find P and check it serves what we serve; raises InvalidRequest (-> 400) naming both values."""
        key = (info.host, info.port)
        route = self._routes.get(key)
        if route is None:
            try:
                route = fetch_route(info.host, info.port)
            except OSError as e:
                raise InvalidRequest("bootstrap_host", f"prefill bootstrap server {info.host}:{info.port} "
                                     f"unreachable: {e}") from None
            self._routes[key] = route
        try:
            check_compatible(PeerConfig(**route.config), self.peer_config)
        except ConfigMismatch as e:
            raise InvalidRequest("bootstrap_host", str(e)) from None
        if route.transfer_backend != self.transfer_backend:
            raise InvalidRequest("bootstrap_host", f"prefill and decode servers are incompatible: transfer_backend: "
                                 f"prefill={route.transfer_backend!r} decode={self.transfer_backend!r}")
        with self._lock:
            self._routes_by_request[request_id] = route
        self.expect(request_id, info)

    # -- engine interface ------------------------------------------------------------------
    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams):
        info = self._take_expected(request_id)
        with self._lock:
            route = self._routes_by_request.pop(request_id)
        self.engine.validate_request(request_id, prompt_token_ids, params)
        if any(r.info.room == info.room for r in self.prealloc_queue) or info.room in self.transfer_queue:
            raise InvalidRequest("bootstrap_room", f"room {info.room} is already in use on this decode server")
        self.prealloc_queue.append(_Room(request_id, list(prompt_token_ids), params, info, route))

    def abort_request(self, request_id: str) -> None:
        for room in self.prealloc_queue:
            if room.request_id == request_id:
                self.prealloc_queue.remove(room)
                self._final(request_id, len(room.prompt_token_ids), "abort")
                return
        for room in self.transfer_queue.values():
            if room.request_id == request_id and room.aborted_at is None:
                room.aborted_at = time.monotonic()
                send_message(self._socket(room.route.zmq_endpoint), Abort(room.info.room, "client gone"))
                return
        self.engine.abort_request(request_id)

    def disagg_busy(self) -> bool:
        return bool(self.prealloc_queue or self.transfer_queue)

    def queue_sizes(self) -> dict:
        return {"pd_prealloc": len(self.prealloc_queue), "pd_transfer": len(self.transfer_queue)}

    # -- stages ----------------------------------------------------------------------------
    def _socket(self, endpoint: str) -> zmq.Socket:
        sock = self._sockets.get(endpoint)
        if sock is None:
            sock = self._sockets[endpoint] = self.ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(endpoint)
            self.poller.register(sock, zmq.POLLIN)
        return sock

    def poll_control(self, timeout_ms: int) -> None:
        if not self._sockets:
            return
        events = dict(self.poller.poll(timeout_ms))
        for endpoint, sock in self._sockets.items():
            while sock in events:
                try:
                    msg = recv_message(sock, flags=zmq.NOBLOCK)
                except zmq.Again:
                    break
                except MessageError as e:
                    logger.warning("bad control message: %s", e)
                    continue
                self._heard[endpoint] = time.monotonic()
                self._on_message(msg)

    def _on_message(self, msg) -> None:
        if isinstance(msg, Heartbeat):
            return
        room = self.transfer_queue.get(getattr(msg, "room", None))
        if room is None:
            logger.warning("%s for unknown room %s", type(msg).__name__, getattr(msg, "room", None))
            return
        if isinstance(msg, HandoffRecord):
            room.record = msg
            room.record_at = time.monotonic()
        elif isinstance(msg, TransferDone):
            room.done = msg
        elif isinstance(msg, (TransferFailed, AbortAck)):  # P has no write in flight into the room's pages
            del self.transfer_queue[room.info.room]
            self.engine.scheduler.allocator.free(room.pages)
            if room.aborted_at is None:
                self._final(room.request_id, len(room.prompt_token_ids), "abort",
                            error=f"prefill server failed the handoff: {msg.reason}")
            elif room.error is None:  # a client abort: its final output is still owed
                self._final(room.request_id, len(room.prompt_token_ids), "abort")

    def _give_up(self, room: _Room, error: str | None, reason: str) -> None:
        """Stop waiting for `room`: the client hears now (error), the pages stay until P confirms."""
        if room.aborted_at is not None:
            return
        room.aborted_at = time.monotonic()
        room.error = error
        if error is not None:
            logger.warning("room %d: %s", room.info.room, error)
            self._final(room.request_id, len(room.prompt_token_ids), "abort", error=error)
        send_message(self._socket(room.route.zmq_endpoint), Abort(room.info.room, reason))

    def _watch_prefill_servers(self, now: float) -> None:
        """Timeouts per room; heartbeats per P that owes us rooms; a silent P is probed and, if gone, its
        rooms' pages are freed at once (a dead process writes nothing; a frozen one might: abort timeout)."""
        owing: set[str] = set()  # P endpoints with rooms (aborted ones included: P still owes an AbortAck)
        for room in list(self.transfer_queue.values()):
            owing.add(room.route.zmq_endpoint)
            if room.aborted_at is None:
                if room.record is None and now - room.sent_at > self.prefill_timeout_s:
                    self._give_up(room, f"prefill of room {room.info.room} did not finish within "
                                        f"{self.prefill_timeout_s:g} s", "prefill timeout")
                elif room.record_at is not None and now - room.record_at > self.transfer_timeout_s:
                    self._give_up(room, f"KV transfer of room {room.info.room} did not finish within "
                                        f"{self.transfer_timeout_s:g} s", "transfer timeout")
        for endpoint in owing:
            if now - self._pinged.get(endpoint, 0.0) >= HEARTBEAT_INTERVAL_S:
                self._hb_seq += 1
                self._pinged[endpoint] = now
                send_message(self._socket(endpoint), Heartbeat(self.name, self._hb_seq, time.time()))
            waiting = [r for r in self.transfer_queue.values() if r.route.zmq_endpoint == endpoint]
            since = max([self._heard.get(endpoint, 0.0)] + [r.sent_at for r in waiting])
            if now - since <= self.heartbeat_timeout_s:
                continue
            gone = not _reachable(waiting[0].info)
            error = (f"prefill server {endpoint} is {'gone' if gone else 'not answering'}: no heartbeat "
                     f"for {now - since:.1f} s")
            for room in waiting:
                if gone:  # nothing can still write into these pages
                    del self.transfer_queue[room.info.room]
                    self.engine.scheduler.allocator.free(room.pages)
                    if room.aborted_at is None or room.error is None:  # its final output is still owed
                        self._final(room.request_id, len(room.prompt_token_ids), "abort",
                                    error=error if room.aborted_at is None else None)
                else:
                    self._give_up(room, error, "prefill server silent")
            self._heard[endpoint] = now  # probe again after another heartbeat timeout

    def advance(self) -> None:
        allocator = self.engine.scheduler.allocator
        page_size = self.peer_config.page_size
        while self.prealloc_queue:
            room = self.prealloc_queue[0]
            need = pages_needed(len(room.prompt_token_ids), page_size)
            if not allocator.can_alloc(need):
                break
            self.prealloc_queue.pop(0)
            room.pages = allocator.alloc(need)
            sock = self._socket(room.route.zmq_endpoint)
            send_message(sock, DecodeRegister(room.info.room, "", self.peer_config))
            send_message(sock, KVDestination(room.info.room, self.backend.session_id, self.backend.layouts,
                                             list(room.pages)))
            self.transfer_queue[room.info.room] = room
            room.sent_at = time.monotonic()
        self._watch_prefill_servers(time.monotonic())
        for room_id, room in list(self.transfer_queue.items()):
            gave_up = room.aborted_at is not None and time.monotonic() - room.aborted_at > self.abort_timeout_s
            if (room.record is None or room.done is None) and not gave_up:
                continue
            del self.transfer_queue[room_id]
            if room.aborted_at is not None:
                allocator.free(room.pages)
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
                self.engine.add_prebuilt_request(room.request_id, room.prompt_token_ids, room.params, room.pages,
                                                 rec.handoff_token, lp, draft_state=draft_state,
                                                 target_hidden=rec.target_hidden, sampler_state=rec.sampler_state)
            except ValueError as e:  # a record that does not fit this server: fail the request, keep serving
                allocator.free(room.pages)
                self._final(room.request_id, len(room.prompt_token_ids), "abort", error=f"bad handoff: {e}")

    def close(self) -> None:
        for sock in self._sockets.values():
            sock.close(0)
        super().close()
