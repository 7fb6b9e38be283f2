"""The prefill server's handoff (P, prefill.py's stages 2c and 3): a room's pages and record on their way to D.

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
     to D, then the pages not streamed yet (the last chunk's, the partial last page) are submitted (each P
     rank writes its heads into the D ranks holding them, one descriptor per page and overlapping head range,
     kv_sender.py; draft-on-both: the draft's layers too). Record
     first: serializing it holds the GIL the writer thread needs. Draft-on-decode-only with streaming, the
     last chunk's features go ahead of the record as a `TargetFeatures` (all but the last position, whose
     draft input is y0), so D's draft extend over them overlaps the last write; the record carries one row.
Once the room's writes are done (prefill.py, stage 4), `_observe` records its stage durations (timeline.py).
"""
from __future__ import annotations

import dataclasses
import logging
import time
from dataclasses import dataclass

import torch

from specpd.core import RequestStatus, SamplingParams
from specpd.disagg.messages import HandoffRecord, KVDestination, TargetFeatures, encode
from specpd.disagg.timeline import between, describe
from specpd.disagg.transfer import TransferStatus
from specpd.disagg.worker import BootstrapInfo
from specpd.kv.allocator import pages_needed

logger = logging.getLogger("specpd.disagg.prefill")  # P's log, one logger for the worker and its handoff


@dataclass
class PrefillRoom:
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
    writes_ended: int = 0  # of `handles`, those seen ended (counted once into P's progress)
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


class PrefillSender:
    """PrefillWorker's handoff half (module docstring): streams each chunk's pages and features, sends the
    record and the rest, counts the writes that ended. It reads the worker's engine, peer_config, stream_chunks,
    last_step, prefilling, control, kv (its ranks' transfer endpoints), inflight and stages, and keeps its
    writes_done."""

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

    def _note_writes(self) -> None:
        """Count the writes that ended since the last step into `writes_done` (P's progress: a D waiting for a
        room's KV waits as long as writes keep landing)."""
        for room in [*self.prefilling.values(), *self.inflight.values()]:
            ended = sum(1 for h in room.handles if h.poll() is not TransferStatus.PENDING)
            self.writes_done += ended - room.writes_ended
            room.writes_ended = ended

    def _stream(self, room: PrefillRoom, req) -> None:
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

    def _stream_features(self, room: PrefillRoom, req, end: int | None = None) -> None:
        """Draft-on-decode-only: the target features of the chunk just computed (up to `end`, default all that
        is computed) go to D now (module docstring, 2c), so D's draft extend over them overlaps P's next chunk,
        or for the last chunk its pages' write, instead of waiting for the record."""
        dest = room.destination
        if self.peer_config.draft_mode != "decode-only" or dest is None or dest.prefill_locally \
                or self._stream_failed(room) or not req.handoff_hidden:
            return
        start, end = max(room.features_sent, dest.cached_tokens), req.num_computed_tokens if end is None else end
        if end > start:
            hidden = _features_from(req.handoff_hidden, start)[:end - start]
            self.control.send(room.identity, TargetFeatures(room.info.room, start, hidden))
            room.features_sent = end

    def _stream_failed(self, room: PrefillRoom) -> bool:
        """Did a write of the room fail (or was refused)? Then nothing more is sent and the room fails once its
        other writes are done."""
        if room.error is None:
            failed = next((h for h in room.handles if h.poll() is TransferStatus.FAILED), None)
            if failed is not None:
                room.error = f"KV transfer failed: {failed.wait().error}"
        return room.error is not None

    def _submit(self, room: PrefillRoom, src: list[int], dst: list[int]) -> bool:
        dest = room.destination
        try:
            room.handles.append(self.kv.submit(dest, src, dst))
        except ValueError as e:  # LayoutMismatch, before any write; D drops what it got on the TransferFailed next
            room.error = f"KV transfer refused: {e}"
            return False
        return True

    def _send(self, room: PrefillRoom) -> None:
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

    def _draft_fields(self, req, cached_tokens: int = 0) -> dict:
        if self.peer_config.draft_mode == "decode-only":  # D runs the draft extend from the target features
            return {"draft_mode": "decode-only", "target_hidden": _features_from(req.handoff_hidden, cached_tokens),
                    "hidden_start": cached_tokens}
        if self.peer_config.draft_mode != "both":
            return {}
        state = req.spec_state  # DraftState from the draft extend over the prompt
        return {"draft_mode": "both", "draft_topk_ids": torch.tensor(state.topk_ids, dtype=torch.int64),
                "draft_topk_probs": torch.tensor(state.topk_probs, dtype=torch.float32),
                "draft_hidden": state.hidden}

    def _observe(self, room: PrefillRoom) -> None:
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
