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
     until `bootstrap_timeout_s` after its request (then it fails and the pages return).
  2c. streaming (chunked prefill, D's destination known; on by default, `--no-pd-stream-chunks`): after each
     engine step that computed a chunk but not the last, the room's newly completed full pages after D's
     cached prefix are submitted to the transfer backend while the next chunk computes. A page is final
     once the target and, draft-on-both, the draft extend covered its last position (`draft_kv_len`; the
     draft KV of a chunk's last position uses the next prompt token, known then). The first such write
     pins the request (`Scheduler.pin`: every page of its prompt now, never preempted), so nothing frees
     or moves its pages under a write. Draft-on-decode-only, the chunk's target features go to D with it
     (`TargetFeatures`), and D runs its draft extend over them while P computes the next chunk.
  3. send: the `HandoffRecord` (y0, logprob and top logprobs, N, params, the seeded generator's state;
     draft-on-both: the draft's first-round top-k ids/probs and hidden; draft-on-decode-only: the prompt's
     target features, captured by the engine, which then loads no draft, those not streamed yet) goes
     to D, then the pages not streamed yet (the last chunk's, the partial last page) are submitted (one
     descriptor per page into D's destination pages; draft-on-both: the draft pool's pages too). Record
     first: serializing it holds the GIL the writer thread needs. Draft-on-decode-only with streaming, the
     last chunk's features go ahead of the record as a `TargetFeatures` (all but the last position, whose
     draft input is y0), so D's draft extend over them overlaps the last write; the record carries one row.
  4. inflight queue: the room's transfer handles are polled every step; when all are done P sends
     `TransferDone` (or, if any failed, `TransferFailed`: no write of the room is in flight then), then
  5. free: `engine.release_handoff` frees the pages and the HTTP request is answered (finish_reason
     "handoff", or an error -> the router drops D's request).
A room is unique on P: a second request or a second D's DecodeRegister for a room in use is refused
(HTTP 400 / TransferFailed to that D) and the first owner goes on. A room no D claims within
`bootstrap_timeout_s` fails.
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
from dataclasses import dataclass

import torch

from specpd.core import InvalidRequest, RequestOutput, RequestStatus, SamplingParams
from specpd.disagg.bootstrap import BootstrapServer, Route
from specpd.disagg.control import PrefillControl
from specpd.disagg.messages import (Abort, AbortAck, DecodeRegister, HandoffRecord, KVDestination, TargetFeatures,
                                    TransferDone, TransferFailed, encode)
from specpd.disagg.timeline import between, describe
from specpd.disagg.transfer import TransferStatus
from specpd.disagg.worker import BootstrapInfo, DisaggWorker
from specpd.kv.allocator import pages_needed

logger = logging.getLogger(__name__)


@dataclass
class _Room:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    info: BootstrapInfo
    identity: bytes | None = None  # D's DEALER, once registered
    destination: KVDestination | None = None
    handles: list = dataclasses.field(default_factory=list)  # TransferHandles: streamed chunks, then the rest
    streamed: int = 0  # pages after D's cached prefix submitted while the prompt was still prefilling
    features_sent: int = 0  # decode-only: target features of positions below this went to D with their chunk
    error: str | None = None  # a write failed or was refused: the room fails once none is in flight
    added_at: float = 0.0  # monotonic time the request entered the bootstrap queue
    marks: dict = dataclasses.field(default_factory=dict)  # stage boundary -> monotonic time (timeline.py)
    chunks: list = dataclasses.field(default_factory=list)  # (start, end) of each prefill chunk's engine step
    computed: int = 0  # prompt tokens with KV as of the last engine step (a new chunk when it grows)
    page_size: int = 0  # P's page size

    @property
    def num_pages(self) -> int:
        """Pages the room's prompt takes on P (what an optimistic room holds before D's destination)."""
        return pages_needed(len(self.prompt_token_ids), self.page_size) if self.page_size else 0


# (stage, start mark, end mark): timeline.py's P stages
_P_STAGES = [("p_admit", "received", "queued"), ("p_wait_destination", "queued", "destination"),
             ("p_queue", "admitted", "prefill_start"), ("p_prefill", "prefill_start", "prefill_end"),
             ("p_record", "prefill_end", "record"), ("p_kv_submit", "record", "kv_submitted"),
             ("p_kv_write", "kv_submitted", "kv_done"), ("p_total", "received", "kv_done")]


class PrefillWorker(DisaggWorker):
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
        self.bootstrap_queue: dict[int, _Room] = {}
        self.prefilling: dict[str, _Room] = {}  # request id -> room in the engine
        self.parked: dict[int, _Room] = {}  # prefilled before D's destination came: holding their pages
        self.inflight: dict[int, _Room] = {}
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
        self.bootstrap_queue[info.room] = _Room(request_id, list(prompt_token_ids), params, info, added_at=now,
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

    def _unpark(self, room_id: int, forget: bool = False) -> _Room:
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

    def _note_chunks(self) -> None:
        """A room whose prompt KV grew in the last engine step computed a chunk in it (timeline.py); one still
        prefilling streams that chunk's pages."""
        start, end = self.last_step
        for rid, room in self.prefilling.items():
            running = self.engine.scheduler.find(rid)
            req = running or self.engine.take_handoff(rid)
            computed = req.num_computed_tokens if req is not None else 0
            if computed > room.computed:
                room.chunks.append((start, end))
                if running is not None and running.status is RequestStatus.RUNNING and self.stream_chunks:
                    self._stream(room, running)
                    self._stream_features(room, running)
            room.computed = computed

    def _stream(self, room: _Room, req) -> None:
        """Submit the full pages a prefilling room completed since its last write (module docstring, 2c)."""
        dest = room.destination
        if dest is None or dest.prefill_locally or self._stream_failed(room):
            return
        ps = self.peer_config.page_size
        valid = req.num_computed_tokens if req.draft_kv_len is None else min(req.num_computed_tokens,
                                                                             req.draft_kv_len)
        first = dest.cached_tokens // ps
        end = min(valid // ps - first, len(dest.dst_page_ids))  # in D's destination pages
        if end <= room.streamed or not (req.kv_pinned or self.engine.scheduler.pin(req)):
            return  # nothing new, or the pool cannot hold the whole prompt now: it all goes with the last chunk
        if self._submit(room, req.pages[first + room.streamed:first + end], dest.dst_page_ids[room.streamed:end]):
            room.streamed = end

    def _stream_features(self, room: _Room, req, end: int | None = None) -> None:
        """Draft-on-decode-only: the target features of the chunk just computed (up to `end`, default all that
        is computed) go to D now (module docstring, 2c), so D's draft extend over them overlaps P's next chunk,
        or for the last chunk its pages' write, instead of waiting for the record."""
        dest = room.destination
        if self.peer_config.draft_mode != "decode_only" or dest is None or dest.prefill_locally \
                or self._stream_failed(room) or not req.handoff_hidden:
            return
        start, end = max(room.features_sent, dest.cached_tokens), req.num_computed_tokens if end is None else end
        if end > start:
            hidden = _features_from(req.handoff_hidden, start)[:end - start]
            self.control.send(room.identity, TargetFeatures(room.info.room, start, hidden))
            room.features_sent = end

    def _stream_failed(self, room: _Room) -> bool:
        """Did a write of the room fail (or was refused)? Then nothing more is sent and the room fails once its
        other writes are done."""
        if room.error is None:
            failed = next((h for h in room.handles if h.poll() is TransferStatus.FAILED), None)
            if failed is not None:
                room.error = f"KV transfer failed: {failed.wait().error}"
        return room.error is not None

    def _submit(self, room: _Room, src: list[int], dst: list[int]) -> bool:
        dest = room.destination
        try:
            room.handles.append(self.backend.submit(dest.transfer_session, src, dst, dest.pools))
        except ValueError as e:  # D drops what it got on the TransferFailed that follows
            room.error = f"KV transfer refused: {e}"
            return False
        return True

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
                self._fail(room, f"prefill ended with {out.finish_reason}", notify_decode=True)
        return passed

    def advance(self) -> None:
        now = time.monotonic()
        for queue in (self.bootstrap_queue, self.parked):
            for room_id, room in list(queue.items()):
                if now - room.added_at > self.bootstrap_timeout_s:  # D never registered the room
                    if queue is self.parked:
                        self._unpark(room_id, forget=True)
                    else:
                        del self.bootstrap_queue[room_id]
                        self._drop_room_state(room_id, forget=True)
                    self._final(room.request_id, len(room.prompt_token_ids), "abort", error=f"no decode server "
                                f"claimed room {room_id} within {self.bootstrap_timeout_s:g} s")
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
            results = [h.wait() for h in room.handles]
            self.engine.release_handoff(room.request_id)
            failed = next((r for r in results if not r.ok), None)
            if room.error is None and failed is None:
                num_pages, num_bytes = sum(r.num_pages for r in results), sum(r.num_bytes for r in results)
                kv = self.kv_stats
                kv["kv_transfers"] += 1
                kv["kv_bytes"] += num_bytes
                kv["kv_transfer_s"] += sum(r.elapsed_s for r in results)
                kv["kv_descriptors"] += num_pages * len(room.destination.pools)
                kv["kv_calls"] += sum(r.num_calls for r in results)
                kv["kv_streamed_pages"] += room.streamed
                self.control.send(room.identity, TransferDone(room_id, num_pages, num_bytes), end_room=room_id)
                self._final(room.request_id, len(room.prompt_token_ids), "handoff")
                self._observe(room)
            else:
                self._fail(room, room.error or f"KV transfer failed: {failed.error}", notify_decode=True)

    def _attach(self, room: _Room) -> None:
        """D's DecodeRegister and KVDestination for the room came: the room knows where its KV goes."""
        room.identity = self._registered.pop(room.info.room)[0]
        room.destination = self._destinations.pop(room.info.room)
        room.marks["destination"] = time.monotonic()

    def _skip(self, room: _Room) -> None:
        """D prefills this room itself (its prefix cache held nearly all of it): answer the request at once."""
        self.control.command(b"forget", str(room.info.room).encode())
        self.kv_stats["prefills_skipped"] += 1
        self._final(room.request_id, len(room.prompt_token_ids), "handoff")

    def _hand_off(self, room: _Room) -> None:
        """A prefilled room whose destination is known: send it (or drop it if D prefills it itself)."""
        if room.destination.prefill_locally:  # learned after an optimistic prefill: the compute was spent
            self.engine.release_handoff(room.request_id)
            self._skip(room)
            return
        self._send(room)

    def _send(self, room: _Room) -> None:
        """The last chunk is computed: the record, then every page not streamed yet; the room goes in flight."""
        req = self.engine.take_handoff(room.request_id)
        dest = room.destination
        first = dest.cached_tokens // self.peer_config.page_size  # D's prefix cache holds the pages before
        if self._stream_failed(room):  # it fails once the writes already submitted are done
            self.inflight[room.info.room] = room
            return
        src = req.pages[first + room.streamed:first + len(dest.dst_page_ids)]
        lp = req.output_logprobs[0] if req.output_logprobs else None
        top = {}
        if lp is not None and lp.top:
            top = {"top_logprob_ids": torch.tensor([t for t, _ in lp.top], dtype=torch.int64),
                   "top_logprobs": torch.tensor([v for _, v in lp.top], dtype=torch.float32)}
        if self.stream_chunks:
            # decode-only: the last chunk's features but the last position's (its draft input is y0, in the
            # record) go now, ahead of its pages: D extends the draft over them while the last write is in flight
            self._stream_features(room, req, end=req.num_prompt_tokens - 1)
        record = HandoffRecord(room=room.info.room, request_id=room.request_id, prompt_len=req.num_prompt_tokens,
                               handoff_token=req.output_token_ids[0],
                               handoff_logprob=lp.logprob if lp is not None else None,
                               sampling_params=room.params, sampler_state=req.sampler_state, **top,
                               **self._draft_fields(req, max(dest.cached_tokens, room.features_sent))).validate()
        # the record (tensors to serialize: up to the prompt's target hiddens) goes first, so this thread
        # is not holding the GIL for it while the writer thread needs it around its transfer call
        frames = encode(record)
        # marked before the record leaves (not after: the control thread may deliver it while this thread
        # waits for the GIL), so D's wait for it contains P's prefill + record on any clock (timeline.py)
        room.marks["record"] = time.monotonic()
        self.control.send_encoded(room.identity, frames)
        if src:
            self._submit(room, src, dest.dst_page_ids[room.streamed:])
        room.marks["kv_submitted"] = time.monotonic()
        self.inflight[room.info.room] = room

    def _observe(self, room: _Room) -> None:
        """A handed-off room's stage durations: into `stages` (/metrics) and P's debug log."""
        room.marks["kv_done"] = time.monotonic()
        if room.chunks:
            room.marks["prefill_start"], room.marks["prefill_end"] = room.chunks[0][0], room.chunks[-1][1]
        durations = between(room.marks, _P_STAGES)
        if room.marks["destination"] > room.marks.get("prefill_end", room.marks["destination"]):
            durations["p_parked"] = room.marks["destination"] - room.marks["prefill_end"]  # optimistic, D late
        durations["p_prefill_chunk"] = [end - start for start, end in room.chunks]
        self.stages.observe(durations)
        if logger.isEnabledFor(logging.DEBUG):
            logger.debug("room %d %s (%d tokens, %d chunks): %s", room.info.room, room.request_id,
                         len(room.prompt_token_ids), len(room.chunks), describe(durations))

    def _draft_fields(self, req, cached_tokens: int = 0) -> dict:
        if self.peer_config.draft_mode == "decode_only":  # D runs the draft extend from the target features
            return {"draft_mode": "decode_only", "target_hidden": _features_from(req.handoff_hidden, cached_tokens),
                    "hidden_start": cached_tokens}
        if self.peer_config.draft_mode != "both":
            return {}
        state = req.spec_state  # DraftState from the draft extend over the prompt
        return {"draft_mode": "both", "draft_topk_ids": torch.tensor(state.topk_ids, dtype=torch.int64),
                "draft_topk_probs": torch.tensor(state.topk_probs, dtype=torch.float32),
                "draft_hidden": state.hidden}

    def _fail(self, room: _Room, reason: str, notify_decode: bool) -> None:
        logger.warning("room %d: %s", room.info.room, reason)
        if notify_decode and room.identity is not None:
            self.control.send(room.identity, TransferFailed(room.info.room, reason), end_room=room.info.room)
        self._final(room.request_id, len(room.prompt_token_ids), "abort", error=reason)

    def close(self) -> None:
        self.bootstrap.close()
        super().close()


def _features_from(parts: list[torch.Tensor], start: int) -> torch.Tensor:
    """The prompt's target features (one tensor per prefill chunk, from position 0) from `start` on,
    concatenating only the chunks that hold them: what each streamed chunk and the record send is the tail."""
    end = sum(p.shape[0] for p in parts)
    tail = []
    for part in reversed(parts):
        if end <= start:
            break
        tail.append(part[max(0, start - (end - part.shape[0])):])
        end -= part.shape[0]
    if not tail:
        return parts[0][:0]
    return tail[0] if len(tail) == 1 else torch.cat(tail[::-1])  # one chunk: a view, sent without a copy
