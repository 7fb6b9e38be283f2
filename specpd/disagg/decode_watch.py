"""D's watch over the prefill servers that hold its rooms (decode.py's stages 1-2): when D stops waiting for P.

Every engine step, for each P that holds rooms of D's (in the prealloc queue: registered with P, no pages yet;
in the transfer queue: pages offered):
  1. Deadlines count silence, not work. A room waiting for its record (`prefill_timeout_s`) or for its KV
     (`transfer_timeout_s`) fails only once neither it nor its P made progress for that long: progress is a
     message for the room (TargetFeatures, the record) or a heartbeat reply of P's whose counters moved (an
     engine step finished: some prefill chunk computed; a KV write ended: a chunk's pages or a room's rest
     landed) or that P sent from inside an engine step (P polls its writes between steps: a long step holds
     back even a landed room's TransferDone), unless that step has run longer than the longer of the two
     timeouts (a wedged engine). A room queued behind a long line on a busy P, or whose chunks keep landing, waits as long
     as the line moves.
  2. The heartbeat rule: a P that has left D's pings unanswered for `heartbeat_timeout_s` (on D's control
     thread's clock, DecodeControl.silent_s) is probed: its bootstrap port refusing, or naming another control
     endpoint (P was restarted), means it is gone: its rooms' pages are freed at once, since nothing can still
     write into them. Else (frozen, or its engine dead) its rooms fail and keep their pages until P answers or
     the abort timeout (a frozen P could still write).
  3. A P whose control connection dropped (DecodeControl.lost: its process exited) is probed at once, not after
     the heartbeat timeout: gone, its rooms fail and free their pages now. Still there (a network blip), rule 2
     decides.
  4. A P whose route was replaced (bootstrap() found a new control endpoint at its bootstrap address) and that
     holds no room of D's any more is forgotten: its socket, its load in /server_info, its clocks.
"""
from __future__ import annotations

import logging
import threading

from specpd.disagg.bootstrap import fetch_route
from specpd.disagg.control import HEARTBEAT_INTERVAL_S
from specpd.disagg.messages import Abort
from specpd.disagg.worker import BootstrapInfo

logger = logging.getLogger("specpd.disagg.decode")

LOST_PROBE_INTERVAL_S = HEARTBEAT_INTERVAL_S  # a dropped connection's P is probed at most this often


def prefill_gone(info: BootstrapInfo, endpoint: str, timeout_s: float = 1.0) -> bool:
    """Is the P that owned `endpoint` gone? Its bootstrap port refuses (the process exited), or answers with
    another control endpoint (a new P in its place). A timeout: alive but frozen, it could still write."""
    try:
        return fetch_route(info.host, info.port, timeout=timeout_s).zmq_endpoint != endpoint
    except ConnectionRefusedError:
        return True
    except OSError as e:
        return isinstance(getattr(e, "reason", None), ConnectionRefusedError)


class PrefillWatch:
    """DecodeWorker's half that decides when to stop waiting for a P (module docstring). It reads the worker's
    control, prealloc_queue, transfer_queue, timeouts, _routes and _lock, and calls its _give_up, _free_pages,
    _final and _send."""

    def _init_watch(self) -> None:
        self._silent_since: dict[str, float] = {}  # P's endpoint -> when the heartbeat rule last fired for it
        self._lost_probed: dict[str, float] = {}  # P's endpoint -> when rule 3 last probed it
        self._replaced: set[str] = set()  # endpoints whose route was replaced (HTTP threads add, under _lock)
        self._watch_lock = threading.Lock()

    def replaced(self, endpoint: str) -> None:
        """bootstrap() (an HTTP thread) found another endpoint at this one's bootstrap address (rule 4)."""
        with self._watch_lock:
            self._replaced.add(endpoint)

    def _forget_route(self, endpoint: str) -> None:
        """P behind `endpoint` is gone or silent: the next request asks its bootstrap server again."""
        with self._lock:
            for key in [k for k, (r, _) in self._routes.items() if r.zmq_endpoint == endpoint]:
                del self._routes[key]

    def _watch_prefill_servers(self, now: float) -> None:
        holding: dict[str, list] = {}  # P's endpoint -> the rooms it holds of ours (prealloc and transfer)
        for room in [*self.prealloc_queue, *self.transfer_queue.values()]:
            holding.setdefault(room.route.zmq_endpoint, []).append(room)
        for room in list(self.transfer_queue.values()):
            if room.aborted_at is None:
                self._deadline(room, now)
        self.control.owing = frozenset(holding)  # the control thread pings these
        for endpoint, rooms in holding.items():
            silent = self.control.silent_s(endpoint)
            since = max([self._silent_since.get(endpoint, 0.0)] + [r.marks["queued"] for r in rooms])
            heartbeat = now - since > self.heartbeat_timeout_s and silent > self.heartbeat_timeout_s
            lost = (endpoint in self.control.lost
                    and now - self._lost_probed.get(endpoint, 0.0) > LOST_PROBE_INTERVAL_S)
            if not (heartbeat or lost):
                continue
            gone = prefill_gone(rooms[0].info, endpoint)
            if lost:
                self._lost_probed[endpoint] = now
                if not gone and not heartbeat:
                    continue  # its connection dropped, its process answers: rule 2 decides
            error = (f"prefill server {endpoint} is {'gone' if gone else 'not answering'}: "
                     + ("its connection dropped" if lost and not heartbeat else f"no heartbeat for {silent:.1f} s"))
            self._forget_route(endpoint)
            for room in rooms:
                self._drop_room(room, error, gone)
            if gone:
                self.control.command(b"forget-peer", endpoint.encode())
                self._lost_probed.pop(endpoint, None)
            self._silent_since[endpoint] = now  # probe again after another heartbeat timeout
        with self._watch_lock:
            forget = [e for e in self._replaced if e not in holding]
            self._replaced.difference_update(forget)
        for endpoint in forget:
            self.control.command(b"forget-peer", endpoint.encode())

    def _deadline(self, room, now: float) -> None:
        """Rule 1: the room's wait for its record or its KV, counted from its or its P's last progress."""
        endpoint = room.route.zmq_endpoint
        progress = max(room.heard_at, self.control.progressed.get(endpoint, 0.0))
        if room.record is None:
            stage, timeout, quiet = "prefill", self.prefill_timeout_s, now - max(room.sent_at, progress)
        else:
            stage, timeout, quiet = "KV transfer", self.transfer_timeout_s, now - max(room.record_at, progress)
        if quiet > timeout:
            last = self.control.load.get(endpoint)
            load = f": {last.load}" if last is not None else ""
            flag = "--pd-prefill-timeout" if stage == "prefill" else "--pd-transfer-timeout"
            self._give_up(room, f"{stage} of room {room.info.room} made no progress for {quiet:.1f} s ({flag} "
                                f"{timeout:g} s; prefill server {endpoint}{load})", f"{stage} timeout")

    def _drop_room(self, room, error: str, gone: bool) -> None:
        """Rules 2-3 for one room: fail it; free its pages now if its P is gone."""
        if room in self.prealloc_queue:  # no pages yet: the client hears, P forgets it by its own timeout
            self.prealloc_queue.remove(room)
            self._final(room.request_id, len(room.prompt_token_ids), "abort", error=error)
        elif gone:  # nothing can still write into these pages
            del self.transfer_queue[room.info.room]
            self._free_pages(room)
            if room.aborted_at is None or room.error is None:  # its final output is still owed
                self._final(room.request_id, len(room.prompt_token_ids), "abort",
                            error=error if room.aborted_at is None else None)
        else:
            self._give_up(room, error, "prefill server silent")

    def _abort_registered(self, room, reason: str) -> None:
        """A room P holds only as registered (prealloc queue) is dropped: P forgets it (its AbortAck is expected)."""
        self._send(room.route.zmq_endpoint, Abort(room.info.room, reason))
