"""The PD control plane's threads (docs/architecture.md §1): the ZMQ sockets between P and D, owned by a thread that
never waits on the engine, so a long prefill batch or decode step never makes a live peer look dead.

- `PrefillControl` (P): the ROUTER socket D's DEALERs talk to. It answers D's heartbeats at once with P's
  load (rooms queued / in flight, seconds into the current step) and progress (engine steps finished, KV
  writes ended), and not at all once P's engine thread died; it stamps every message from a D with its
  arrival (`heard`, per D: a claimed room waits on P while its D speaks); it refuses a `DecodeRegister` with
  a mismatched config or for a room another D owns (it tracks each room's owner until the engine thread
  sends the room's last message); everything else waits for the engine thread in its inbox.
- `DecodeControl` (D): one DEALER per P, created on the first message to it; pings every P that holds rooms of
  D's each HEARTBEAT_INTERVAL_S and stamps every message from a P on its own clock (`heard`), so D's own long
  engine step never reads as P's silence; a reply whose progress counters moved, or sent from inside an engine
  step not yet longer than D's longest deadline (a long prefill step is work; a longer one is a wedged
  engine), stamps `progressed`. A
  monitor on each DEALER records when its TCP connection to P dropped (`lost`): a P process that exited
  closes it at once, so D asks P's bootstrap server again before it trusts that route, however soon a
  restarted P is back, and fails that P's rooms at once if it is gone (a frozen P keeps its connection).
The engine threads (prefill.py, decode.py) talk to these through ControlThread's inbox and commands
(worker.py); the control threads know those workers only by what they read of them (`PrefillSide`,
`DecodeSide`), so this module imports neither.
"""
from __future__ import annotations

import collections
import logging
import time
from typing import Protocol

import zmq
from zmq.utils import monitor as zmq_monitor

from specpd.disagg.messages import (ConfigMismatch, DecodeRegister, Heartbeat, KVDestination, PeerConfig,
                                    TransferFailed, check_compatible, encode)
from specpd.disagg.worker import CONTROL_TICK_S, ControlThread

logger = logging.getLogger(__name__)

HEARTBEAT_INTERVAL_S = 1.0  # D -> P while P owes D rooms (at least 4 per heartbeat timeout); P answers each


class PrefillSide(Protocol):
    """What PrefillControl reads of P's engine-thread worker (prefill.PrefillWorker), from its own thread."""

    ctx: zmq.Context
    engine_failed: bool
    step_started: float | None
    steps_done: int
    writes_done: int
    inflight: dict
    peer_config: PeerConfig

    def rooms_queued(self) -> int: ...


class DecodeSide(Protocol):
    """What DecodeControl reads of D's engine-thread worker (decode.DecodeWorker) when it is built."""

    ctx: zmq.Context
    name: str
    heartbeat_timeout_s: float
    prefill_timeout_s: float
    transfer_timeout_s: float


class PrefillControl(ControlThread):
    """P's control thread: the ROUTER socket D's DEALERs talk to (module docstring)."""

    def __init__(self, worker: PrefillSide, host: str, advertise_host: str):
        super().__init__(worker.ctx, "specpd-prefill-control")
        self.worker = worker
        self.router = self.ctx.socket(zmq.ROUTER)
        self.router.setsockopt(zmq.LINGER, 0)
        self.endpoint = f"tcp://{advertise_host}:{self.router.bind_to_random_port(f'tcp://{host}')}"
        self.poller.register(self.router, zmq.POLLIN)
        self.owners: dict[int, bytes] = {}  # room -> the identity of the D that registered it first
        self.heard: dict[bytes, float] = {}  # D's identity -> monotonic arrival of its last message (engine reads)
        self.heartbeats = 0

    def _peer_sockets(self):
        return [(self.router, None)]

    def _on_peer(self, sock, identity: bytes, msg, arrived_at: float) -> None:
        self.heard[identity] = arrived_at
        if isinstance(msg, Heartbeat):
            w = self.worker
            if w.engine_failed:  # alive process, dead engine: D must see a dead P
                return
            started = w.step_started
            reply = Heartbeat(self.endpoint, msg.seq, time.time(), rooms_queued=w.rooms_queued(),
                              rooms_inflight=len(w.inflight),
                              step_s=0.0 if started is None else max(0.0, time.monotonic() - started),
                              steps=w.steps_done, writes=w.writes_done)
            self._reply(identity, reply)
            self.heartbeats += 1
            return
        room = getattr(msg, "room", None)
        owner = self.owners.get(room)
        if owner is not None and owner != identity:  # another D holds this room: refuse, leave the owner be
            if isinstance(msg, DecodeRegister):
                self._reply(identity, TransferFailed(msg.room, f"room {msg.room} is already in use on the "
                                                               f"prefill server by another decode server"))
            return
        if isinstance(msg, DecodeRegister):
            try:
                check_compatible(self.worker.peer_config, msg.config)
            except ConfigMismatch as e:
                self._reply(identity, TransferFailed(msg.room, str(e)))
                return
            self.owners[room] = identity
        elif isinstance(msg, KVDestination) and owner is None:  # D registers first on the same socket: a stray
            return
        self._queue(identity, msg, arrived_at)

    def _reply(self, identity: bytes, msg) -> None:
        self.router.send_multipart([identity, *encode(msg)], flags=zmq.NOBLOCK, copy=False)

    def _deliver(self, identity: bytes, frames: list, end_room: int | None) -> None:
        try:
            self.router.send_multipart([identity, *frames], flags=zmq.NOBLOCK, copy=False)
        except zmq.Again:
            logger.warning("decode server %r is not reading its control socket: message dropped", identity)
        if end_room is not None and self.owners.get(end_room) == identity:
            del self.owners[end_room]

    def _on_command(self, frames: list[bytes]) -> None:
        if frames[0] == b"forget":  # the engine dropped a room without telling its D
            self.owners.pop(int(frames[1]), None)

    def _close_sockets(self) -> None:
        self.router.close(0)



class DecodeControl(ControlThread):
    """D's control thread: one DEALER per P (created on the first message to it), the heartbeats, and the
    time every message from a P arrived (`heard`), on a clock no engine step stalls."""

    def __init__(self, worker: DecodeSide):
        super().__init__(worker.ctx, "specpd-decode-control")
        self.name = worker.name
        self.interval_s = min(HEARTBEAT_INTERVAL_S, worker.heartbeat_timeout_s / 4)
        self.sockets: dict[bytes, zmq.Socket] = {}  # P's control endpoint -> DEALER (control thread only)
        self.heard: dict[str, float] = {}  # P's endpoint -> monotonic arrival of its last message
        # P's endpoint -> monotonic time its connection dropped, while it stays down (read by HTTP threads)
        self.lost: dict[str, float] = {}
        self._monitors: dict[bytes, zmq.Socket] = {}  # P's endpoint -> its DEALER's monitor (PAIR)
        self.load: dict[str, Heartbeat] = {}  # P's endpoint -> its last heartbeat reply
        # P's endpoint -> monotonic arrival of the last reply whose progress counters moved (read by the engine)
        self.progressed: dict[str, float] = {}
        # a P step running longer than D's longest deadline is a wedged engine, not progress
        self.step_limit_s = max(worker.prefill_timeout_s, worker.transfer_timeout_s)
        self.owing: frozenset[str] = frozenset()  # endpoints of Ps holding rooms of ours (set by the engine thread)
        self.rtt_s: collections.deque = collections.deque(maxlen=2000)  # heartbeat round trips, newest last
        self._pinged: dict[str, float] = {}
        self._sent: dict[int, float] = {}  # heartbeat seq -> monotonic send time
        self._seq = 0
        # P's endpoint -> when the oldest ping it has not answered went out (any message from P answers it)
        self.unanswered: dict[str, float] = {}
        self.ticked = time.monotonic()  # the control thread's last tick: it had read every message before it
        self.stalled_s = worker.heartbeat_timeout_s / 2  # a gap between ticks this long: this thread was stalled

    def _peer_sockets(self):
        return [(sock, endpoint) for endpoint, sock in self.sockets.items()]

    def _socket(self, endpoint: bytes) -> zmq.Socket:
        sock = self.sockets.get(endpoint)
        if sock is None:
            sock = self.sockets[endpoint] = self.ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            self._monitors[endpoint] = sock.get_monitor_socket(zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED)
            sock.connect(endpoint.decode())
            self.poller.register(sock, zmq.POLLIN)
        return sock

    def _read_monitors(self, now: float) -> None:
        """Connection events of the DEALERs since the last tick: a dropped one goes to `lost` until it is back."""
        for endpoint, mon in self._monitors.items():
            while True:
                try:
                    event = zmq_monitor.recv_monitor_message(mon, flags=zmq.NOBLOCK)["event"]
                except zmq.Again:
                    break
                name = endpoint.decode()
                if event == zmq.EVENT_DISCONNECTED:
                    self.lost.setdefault(name, now)
                elif event == zmq.EVENT_CONNECTED:
                    self.lost.pop(name, None)

    def _drop_socket(self, endpoint: bytes) -> None:
        sock, mon = self.sockets.pop(endpoint, None), self._monitors.pop(endpoint, None)
        if sock is not None:
            self.poller.unregister(sock)
            sock.disable_monitor()
            sock.close(0)
        if mon is not None:
            mon.close(0)

    def _on_peer(self, sock, endpoint: bytes, msg, arrived_at: float) -> None:
        name = endpoint.decode()
        self.heard[name] = arrived_at
        self.unanswered.pop(name, None)
        if isinstance(msg, Heartbeat):
            sent = self._sent.pop(msg.seq, None)
            if sent is not None:
                self.rtt_s.append(arrived_at - sent)
            last = self.load.get(name)
            moved = last is not None and (last.steps, last.writes) != (msg.steps, msg.writes)
            if moved or 0.0 < msg.step_s <= self.step_limit_s:  # a step finished, a write ended, or one runs
                self.progressed[name] = arrived_at
            self.load[name] = msg
            return
        self._queue(name, msg, arrived_at)

    def _deliver(self, endpoint: bytes, frames: list, end_room: int | None) -> None:
        try:
            self._socket(endpoint).send_multipart(frames, flags=zmq.NOBLOCK, copy=False)
        except zmq.Again:  # P stopped reading (or never connected): the heartbeat rule decides
            logger.warning("prefill server %s is not reading its control socket: message dropped", endpoint)

    def _on_command(self, frames: list[bytes]) -> None:
        if frames[0] == b"forget-peer":  # P is gone (or replaced): drop its socket and all we knew of it
            self._drop_socket(frames[1])
            name = frames[1].decode()
            for known in (self._pinged, self.unanswered, self.lost, self.load, self.progressed, self.heard):
                known.pop(name, None)

    def _tick(self, now: float) -> None:
        self._read_monitors(now)
        if now - self.ticked > self.stalled_s:  # this thread was stalled (our process, our VM): so was P's reply
            for endpoint in self.unanswered:
                self.unanswered[endpoint] = now
        self.ticked = now
        for endpoint in self.owing:
            if now - self._pinged.get(endpoint, 0.0) < self.interval_s:
                continue
            self._seq += 1
            self._pinged[endpoint] = now
            self._sent[self._seq] = now
            self.unanswered.setdefault(endpoint, now)
            if len(self._sent) > 10000:  # pings a dead P never answered
                self._sent = dict(list(self._sent.items())[-1000:])
            self._deliver(endpoint.encode(), encode(Heartbeat(self.name, self._seq, time.time())), None)

    def _wait_s(self) -> float:
        return min(CONTROL_TICK_S, self.interval_s)

    def silent_s(self, endpoint: str) -> float:
        """How long P has left a ping unanswered, on this thread's clock: from the oldest unanswered ping to
        the last tick, before which every message that had arrived was read. A stall of this process (the GIL,
        the CPU, a descheduled VM) stalls the pings and the ticks alike: a tick that finds itself half a
        heartbeat timeout after the last one restarts the clock of the pings still out, so it never reads as
        P's silence."""
        sent = self.unanswered.get(endpoint)
        return 0.0 if sent is None else max(0.0, self.ticked - sent)

    def _close_sockets(self) -> None:
        for endpoint in list(self.sockets):
            self._drop_socket(endpoint)

    def rtt_ms(self) -> dict:
        rtts = sorted(self.rtt_s)
        if not rtts:
            return {}
        pick = lambda q: round(1000 * rtts[min(len(rtts) - 1, int(q * len(rtts)))], 3)  # noqa: E731
        return {"p50": pick(0.5), "p99": pick(0.99), "max": round(1000 * rtts[-1], 3), "count": len(rtts)}
