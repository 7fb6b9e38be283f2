"""The prefill server (P): prompt KV in, handoff out. It never streams tokens.

A request's life on P, keyed by its `bootstrap_room`:
  1. bootstrap queue: the HTTP request (with the router's room) waits here until D's `DecodeRegister` and
     `KVDestination` for the room arrived on P's ROUTER control socket (they may come first: kept in
     `_destinations`). D's PeerConfig is checked here; a mismatch answers `TransferFailed` naming both values.
  2. waiting queue: `engine.add_request(prefill_only=True)`; the engine batches prefills with the normal
     scheduler, samples y0 at position N-1 and keeps the pages (`engine.take_handoff`).
     Optimistic prefill (on by default; `--no-pd-optimistic-prefill`): a room enters the waiting queue as soon
     as its request arrives, before D's destination, while the pages of rooms without one (prefilling or
     parked) stay within half of P's pool; D's destination joins it when it comes (it may announce D's
     cached prefix or that D prefills itself, which P learns only then).
  2b. parked: a room prefilled before its destination came holds its pages here until it comes (then 3), or
     until the bootstrap timeout (below; then it fails and the pages return).
  2c. streaming (chunked prefill, D's destination known; on by default, `--no-pd-stream-chunks`): each
     chunk's newly completed full pages (and, draft-on-decode-only, its target features) go to D while the
     next chunk computes (prefill_send.py).
  3. send: the `HandoffRecord` goes to D, then the pages not streamed yet are submitted (prefill_send.py).
  4. inflight queue: the room's transfer handles are polled every step; when all are done P sends
     `TransferDone` (or, if any failed, `TransferFailed`: no write of the room is in flight then), then
  5. free: `engine.release_handoff` frees the pages and the HTTP request is answered (finish_reason
     "handoff", or an error -> the router drops D's request).
A room is unique on P: a second request or a second D's DecodeRegister for a room in use is refused
(HTTP 400 / TransferFailed to that D) and the first owner goes on. The bootstrap timeout (`bootstrap_timeout_s`)
counts silence, not waiting: a room no D claimed (no DecodeRegister) fails that long after its request came; a
claimed room waiting for its destination (D registers as it admits the request, then waits for pages of its
own) fails only once its D has said nothing (no message, no heartbeat: D pings while it holds rooms of P's)
for that long. A registration whose request never came fails that long after it.
Control thread (`PrefillControl`, control.py): the ROUTER socket, heartbeats answered with P's load, room
ownership; everything else reaches the engine thread through its inbox.
Abort (client / router gone) drops a room still in the bootstrap queue; a room in the engine is aborted
there unless it streamed pages already; a room in flight (or streaming) finishes its transfer first (D owns
the destination pages).
"""
from __future__ import annotations

import dataclasses
import logging
import time

from specpd.core import InvalidRequest, RequestOutput, SamplingParams
from specpd.disagg.bootstrap import BootstrapServer, Route
from specpd.disagg.control import PrefillControl
from specpd.disagg.messages import (Abort, AbortAck, DecodeRegister, KVDestination, TransferDone, TransferFailed)
from specpd.disagg.prefill_send import PrefillRoom, PrefillSender
from specpd.disagg.transfer import TransferStatus
from specpd.disagg.worker import DisaggWorker

logger = logging.getLogger(__name__)


class PrefillWorker(PrefillSender, DisaggWorker):
    role = "prefill"

    def __init__(self, engine, transfer_backend: str, host: str = "127.0.0.1", bootstrap_port: int = 8998,
                 bootstrap_timeout_s: float = 300.0, optimistic_prefill: bool = True,
                 advertise_host: str | None = None, stream_chunks: bool = True):
        super().__init__(engine, transfer_backend, host, advertise_host)
        self.bootstrap_timeout_s = bootstrap_timeout_s
        self.optimistic_prefill = optimistic_prefill
        self.optimistic_pages_max = engine.total_pages // 2  # pages rooms without a destination may hold
        self.stream_chunks = stream_chunks  # submit each prefill chunk's full pages while the next one computes
        # completed handoffs: transfers, bytes, seconds inside the backend, descriptors (pages x pools), calls
        self.kv_stats = {"kv_transfers": 0, "kv_bytes": 0, "kv_transfer_s": 0.0, "kv_descriptors": 0, "kv_calls": 0,
                         "prefills_skipped": 0,  # rooms D prefilled itself (its prefix cache held the rest)
                         "kv_streamed_pages": 0}  # pages of completed handoffs written before the last chunk
        self.bootstrap_queue: dict[int, PrefillRoom] = {}
        self.prefilling: dict[str, PrefillRoom] = {}  # request id -> room in the engine
        self.parked: dict[int, PrefillRoom] = {}  # prefilled before D's destination came: holding their pages
        self.inflight: dict[int, PrefillRoom] = {}
        self.writes_done = 0  # KV writes seen ended (P's heartbeat reports it as progress)
        self.control = PrefillControl(self, host, self.advertise_host)
        self.endpoint = self.control.endpoint
        self.control.start()
        self.bootstrap = BootstrapServer(host, bootstrap_port, Route(self.endpoint, transfer_backend,
                                                                     dataclasses.asdict(self.peer_config))).start()
        # room -> (D's identity, its DecodeRegister, monotonic arrival): D may register before our HTTP request
        self._registered: dict[int, tuple[bytes, DecodeRegister, float]] = {}
        self._destinations: dict[int, KVDestination] = {}  # room -> KVDestination arrived before the request

    # -- engine interface ------------------------------------------------------------------
    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams):
        info, received_at = self._take_expected(request_id)
        self.engine.validate_request(request_id, prompt_token_ids, params)
        if self._room_in_use(info.room):
            raise InvalidRequest("bootstrap_room", f"room {info.room} is already in use on this prefill server")
        now = time.monotonic()
        self.bootstrap_queue[info.room] = PrefillRoom(request_id, list(prompt_token_ids), params, info, added_at=now,
                                                marks={"received": received_at, "queued": now},
                                                page_size=self.peer_config.page_size)

    def _room_in_use(self, room: int) -> bool:
        return (room in self.bootstrap_queue or room in self.inflight or room in self.parked
                or any(r.info.room == room for r in self.prefilling.values()))

    def rooms_queued(self) -> int:
        """Rooms waiting for their D or for their prefill, or inside one (read by the control thread)."""
        return len(self.bootstrap_queue) + len(self.prefilling) + len(self.parked)

    def pages_waiting(self) -> int:
        """Pages held (or about to be) by rooms without D's destination: prefilling optimistically or parked."""
        return sum(r.num_pages for r in [*self.prefilling.values(), *self.parked.values()] if r.destination is None)

    def abort_request(self, request_id: str) -> None:
        for room, r in list(self.bootstrap_queue.items()):
            if r.request_id == request_id:
                del self.bootstrap_queue[room]
                self._drop_room_state(room, forget=True)
                self._final(request_id, len(r.prompt_token_ids), "abort")
                return
        if request_id in self.prefilling and not self.prefilling[request_id].handles:  # streaming: it finishes
            self.engine.abort_request(request_id)
        for room_id, r in list(self.parked.items()):
            if r.request_id == request_id:  # no write was ever issued: its D, if any, hears nothing
                self._unpark(room_id, forget=True)
                self._final(request_id, len(r.prompt_token_ids), "abort")

    def _unpark(self, room_id: int, forget: bool = False) -> PrefillRoom:
        room = self.parked.pop(room_id)
        self.engine.release_handoff(room.request_id)
        self._drop_room_state(room_id, forget=forget)
        return room

    def disagg_busy(self) -> bool:  # a registered room keeps the loop taking control messages
        return bool(self.bootstrap_queue or self.inflight or self._registered or self.parked)

    def stats(self) -> dict:
        return {**super().stats(), **self.kv_stats, "bootstrap_port": self.bootstrap.port,
                "bootstrap_host": self.advertise_host,
                "pd_heartbeats_answered": self.control.heartbeats}

    def queue_sizes(self) -> dict:
        return {"pd_bootstrap": len(self.bootstrap_queue), "pd_prefilling": len(self.prefilling),
                "pd_parked": len(self.parked), "pd_inflight": len(self.inflight),
                "pd_pages_waiting": self.pages_waiting()}

    # -- stages ----------------------------------------------------------------------------
    def on_message(self, identity: bytes, msg, arrived_at: float) -> None:
        if isinstance(msg, DecodeRegister):  # the control thread checked the config and the owner
            self._registered[msg.room] = (identity, msg, arrived_at)
        elif isinstance(msg, KVDestination):
            self._destinations[msg.room] = msg
        elif isinstance(msg, Abort):
            prefilling = next((r for r in self.prefilling.values() if r.info.room == msg.room), None)
            if prefilling is not None and prefilling.destination is None:  # optimistic: nothing was written
                self.engine.abort_request(prefilling.request_id)  # its abort output fails the HTTP request
                self._drop_room_state(msg.room)
                self.control.send(identity, AbortAck(msg.room), end_room=msg.room)
                return
            if msg.room in self.parked:
                room = self._unpark(msg.room)
                self.control.send(identity, AbortAck(msg.room), end_room=msg.room)
                self._final(room.request_id, len(room.prompt_token_ids), "abort", error=f"decode aborted: {msg.reason}")
                return
            # a room in the engine or in flight finishes its transfer: TransferDone tells D it may free
            if prefilling is not None or msg.room in self.inflight:
                return
            room = self.bootstrap_queue.pop(msg.room, None)
            self._drop_room_state(msg.room)
            self.control.send(identity, AbortAck(msg.room), end_room=msg.room)
            if room is not None:
                self._final(room.request_id, len(room.prompt_token_ids), "abort", error=f"decode aborted: {msg.reason}")
        else:
            logger.warning("unexpected %s on the prefill control socket", type(msg).__name__)

    def _drop_room_state(self, room: int, forget: bool = False) -> None:
        """Forget what D sent for `room`; `forget`: its D will not hear from us, so free its owner slot too."""
        registered = self._registered.pop(room, None)
        self._destinations.pop(room, None)
        if forget and registered is not None:
            self.control.command(b"forget", str(room).encode())

    def on_engine_outputs(self, outputs: list[RequestOutput]) -> list[RequestOutput]:
        self._note_chunks()
        passed = []
        for out in outputs:
            room = self.prefilling.pop(out.request_id, None)
            if room is None:
                passed.append(out)
            elif out.finish_reason == "handoff" and room.destination is None:  # optimistic: D is not there yet
                self.parked[room.info.room] = room
            elif out.finish_reason == "handoff":
                self._hand_off(room)
            else:  # aborted in the engine
                self._fail(room, out.error or f"prefill ended with {out.finish_reason}", notify_decode=True)
        return passed

    def _unclaimed_error(self, room_id: int, room: PrefillRoom, now: float) -> str | None:
        """Why a room waiting for its destination fails now (the bootstrap timeout: module docstring), or None."""
        registered = self._registered.get(room_id)
        if registered is None:
            if now - room.added_at > self.bootstrap_timeout_s:
                return f"no decode server claimed room {room_id} within {self.bootstrap_timeout_s:g} s"
            return None
        identity, _, at = registered
        silent = now - max(room.added_at, at, self.control.heard.get(identity, 0.0))
        if silent > self.bootstrap_timeout_s:
            return (f"the decode server that claimed room {room_id} has been silent for {silent:.0f} s "
                    f"(--pd-bootstrap-timeout {self.bootstrap_timeout_s:g} s) and never offered its pages")
        return None

    def advance(self) -> None:
        now = time.monotonic()
        self._note_writes()
        for queue in (self.bootstrap_queue, self.parked):
            for room_id, room in list(queue.items()):
                if (error := self._unclaimed_error(room_id, room, now)) is not None:
                    if queue is self.parked:
                        self._unpark(room_id, forget=True)
                    else:
                        del self.bootstrap_queue[room_id]
                        self._drop_room_state(room_id, forget=True)
                    self._final(room.request_id, len(room.prompt_token_ids), "abort", error=error)
        for room in [*self.prefilling.values(), *self.parked.values()]:  # optimistic rooms: has their D come?
            if room.destination is None and room.info.room in self._registered \
                    and room.info.room in self._destinations:
                self._attach(room)
                if room.info.room in self.parked:
                    self._hand_off(self.parked.pop(room.info.room))
        for room_id, (identity, _, at) in list(self._registered.items()):
            if not self._room_in_use(room_id) and now - at > self.bootstrap_timeout_s:  # request never came
                self._drop_room_state(room_id)
                self.control.send(identity, TransferFailed(room_id, "the prefill server never received the "
                                                                    "request for this room"), end_room=room_id)
        for room_id, room in list(self.bootstrap_queue.items()):
            if room_id in self._registered and room_id in self._destinations:
                del self.bootstrap_queue[room_id]
                self._attach(room)
                if room.destination.prefill_locally:  # D's prefix cache holds nearly all of it: D prefills the rest
                    self._skip(room)
                    continue
            elif not (self.optimistic_prefill
                      and self.pages_waiting() + room.num_pages <= self.optimistic_pages_max):
                continue
            else:  # optimistic: prefill now, D's destination joins the room when it comes
                del self.bootstrap_queue[room_id]
            try:
                self.engine.add_request(room.request_id, room.prompt_token_ids, room.params, prefill_only=True)
            except Exception as e:  # noqa: BLE001 - validated at add; report rather than kill the thread
                self._fail(room, f"prefill rejected: {e}", notify_decode=True)
                continue
            room.marks["admitted"] = time.monotonic()
            self.prefilling[room.request_id] = room
        for room_id, room in list(self.inflight.items()):
            if any(h.poll() is TransferStatus.PENDING for h in room.handles):
                continue
            del self.inflight[room_id]  # no write of the room is in flight: its pages may go, D may hear
            self.writes_done += len(room.handles) - room.writes_ended
            results = [h.wait() for h in room.handles]
            self.engine.release_handoff(room.request_id)
            failed = next((r for r in results if not r.ok), None)
            if room.error is None and failed is None:
                num_pages, num_bytes = sum(r.num_pages for r in results), sum(r.num_bytes for r in results)
                kv = self.kv_stats
                kv["kv_transfers"] += 1
                kv["kv_bytes"] += num_bytes
                kv["kv_transfer_s"] += sum(r.elapsed_s for r in results)
                kv["kv_descriptors"] += sum(r.num_descriptors for r in results)
                kv["kv_calls"] += sum(r.num_calls for r in results)
                kv["kv_streamed_pages"] += room.streamed
                self.control.send(room.identity, TransferDone(room_id, num_pages, num_bytes), end_room=room_id)
                self._final(room.request_id, len(room.prompt_token_ids), "handoff")
                self._observe(room)
            else:
                self._fail(room, room.error or f"KV transfer failed: {failed.error}", notify_decode=True)

    def _attach(self, room: PrefillRoom) -> None:
        """D's DecodeRegister and KVDestination for the room came: the room knows where its KV goes."""
        room.identity = self._registered.pop(room.info.room)[0]
        room.destination = self._destinations.pop(room.info.room)
        room.marks["destination"] = time.monotonic()

    def _skip(self, room: PrefillRoom) -> None:
        """D prefills this room itself (its prefix cache held nearly all of it): answer the request at once."""
        self.control.command(b"forget", str(room.info.room).encode())
        self.kv_stats["prefills_skipped"] += 1
        self._final(room.request_id, len(room.prompt_token_ids), "handoff")

    def _hand_off(self, room: PrefillRoom) -> None:
        """A prefilled room whose destination is known: send it (or drop it if D prefills it itself)."""
        if room.destination.prefill_locally:  # learned after an optimistic prefill: the compute was spent
            self.engine.release_handoff(room.request_id)
            self._skip(room)
            return
        self._send(room)

    def _fail(self, room: PrefillRoom, reason: str, notify_decode: bool) -> None:
        logger.warning("room %d: %s", room.info.room, reason)
        if notify_decode and room.identity is not None:
            self.control.send(room.identity, TransferFailed(room.info.room, reason), end_room=room.info.room)
        self._final(room.request_id, len(room.prompt_token_ids), "abort", error=reason)

    def close(self) -> None:
        self.bootstrap.close()
        super().close()
