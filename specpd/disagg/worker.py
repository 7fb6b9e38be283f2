"""What the prefill and decode workers share: the engine interface AsyncEngine drives, the control thread,
the transfer backend, the PeerConfig, and the bootstrap fields the router put in the request body.

A worker wraps an LLMEngine and is driven exactly like one (add_request / abort_request / step /
has_unfinished_requests / stats) from AsyncEngine's engine thread. The HTTP handler (loop thread) only calls
`expect` (and D's `bootstrap`) before submit.

Threads (docs/architecture.md §1: the control plane never waits on the engine):
- the engine thread owns every queue of a room's life, the scheduler and its page allocator, and the
  engine: it alone allocates or frees pages, submits KV writes, and decides a room's fate (fail, abort,
  hand off). It talks to peers only through `ControlThread.send` and `ControlThread.take`.
- the control thread (`ControlThread`, one per worker) owns the ZMQ control sockets. It receives every
  peer message the moment it arrives and stamps it with its own clock, answers what needs no engine state
  at once (P: heartbeats with P's load, a DecodeRegister with a mismatched config or for a room another D
  owns; D: sends the heartbeats and records their replies), and queues the rest for the engine thread.
  It never takes a lock the engine thread holds across a step and never touches pages, so a long prefill,
  a draft extend over a 2k prompt or the step loop holding the GIL in Python only delays it by the GIL
  switch interval (the servers set 0.5 ms; a torch op releases the GIL).
"""
from __future__ import annotations

import dataclasses
import itertools
import logging
import queue
import threading
import time
from dataclasses import dataclass

import zmq

from specpd.core import InvalidRequest, RequestOutput
from specpd.disagg.messages import KV_LAYOUT, MessageError, PeerConfig, decode, encode
from specpd.disagg.timeline import StageStats
from specpd.disagg.kv_sender import KVTransfers

logger = logging.getLogger(__name__)

IDLE_POLL_S = 0.002  # how long an idle step waits for control messages (the engine thread spins on us)
CONTROL_TICK_S = 0.05  # the control thread's longest sleep: how fast it notices close() and due heartbeats
_ids = itertools.count()


class ControlThread:
    """A thread that owns the control sockets (module docstring). Subclasses say how a peer message is
    received (`_peer_sockets`, `_on_peer`) and how an outgoing one is delivered (`_deliver`).

    Engine thread -> control thread: `send(peer, msg)` encodes on the caller's thread and pushes the frames
    over an inproc socket (zero copy); the control thread delivers them in order. Control thread -> engine
    thread: `inbox`, (peer, message, monotonic arrival time) tuples, drained by `take`."""

    def __init__(self, ctx: zmq.Context, name: str):
        self.ctx = ctx
        self.inbox: queue.SimpleQueue = queue.SimpleQueue()
        addr = f"inproc://specpd-control-{next(_ids)}"
        self._pull = ctx.socket(zmq.PULL)
        self._pull.bind(addr)
        self._push = ctx.socket(zmq.PUSH)  # used by the engine thread only
        self._push.setsockopt(zmq.LINGER, 0)
        self._push.connect(addr)
        self.poller = zmq.Poller()  # control thread only
        self.poller.register(self._pull, zmq.POLLIN)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self.wakeup = None  # set by the engine's driver (AsyncEngine): an idle engine thread waits on its inbox

    def start(self) -> "ControlThread":
        self._thread.start()
        return self

    # -- engine thread -----------------------------------------------------------------------
    def send(self, peer: bytes, msg, end_room: int | None = None) -> None:
        """Queue `msg` for `peer`. `end_room`: the message closes that room's conversation with its owner."""
        self.send_encoded(peer, encode(msg), end_room)

    def send_encoded(self, peer: bytes, frames: list, end_room: int | None = None) -> None:
        """`send` for frames already `encode`d: a caller that marks a time between serializing a message and
        letting it go (no peer can have it before this call)."""
        tag = b"-" if end_room is None else str(end_room).encode()
        self._push.send_multipart([tag, peer, *frames], copy=False)

    def command(self, *frames: bytes) -> None:
        """A control-thread command without a message (e.g. forget a room or a peer)."""
        self._push.send_multipart([b"!", *frames])

    def take(self, timeout_s: float = 0.0) -> list[tuple]:
        """Every queued (peer, message, arrived_at); waits up to `timeout_s` for the first."""
        items = []
        try:
            items.append(self.inbox.get(timeout=timeout_s) if timeout_s > 0 else self.inbox.get_nowait())
            while True:
                items.append(self.inbox.get_nowait())
        except queue.Empty:
            return items

    def close(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(2.0)
        self._push.close(0)

    # -- control thread ----------------------------------------------------------------------
    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                events = dict(self.poller.poll(int(self._wait_s() * 1000)))
                for sock, peer in self._peer_sockets():
                    while sock in events and not sock.closed:
                        try:
                            frames = sock.recv_multipart(flags=zmq.NOBLOCK, copy=False)
                        except zmq.Again:
                            break
                        now = time.monotonic()  # per message: one read later in this batch came later
                        sender = peer
                        if sender is None:  # a ROUTER: the routing frame names the peer
                            sender, frames = bytes(frames[0].buffer), frames[1:]
                        try:
                            msg = decode(frames)
                        except MessageError as e:
                            logger.warning("bad control message from %r: %s", sender, e)
                            continue
                        self._on_peer(sock, sender, msg, now)
                while self._pull in events:
                    try:
                        frames = self._pull.recv_multipart(flags=zmq.NOBLOCK, copy=False)
                    except zmq.Again:
                        break
                    tag = bytes(frames[0].buffer)
                    if tag == b"!":
                        self._on_command([bytes(f.buffer) for f in frames[1:]])
                    else:
                        self._deliver(bytes(frames[1].buffer), frames[2:], None if tag == b"-" else int(tag))
                self._tick(time.monotonic())
        except Exception:  # noqa: BLE001 - a dead control thread must be loud; peers will see silence
            logger.exception("control thread died")
        finally:
            self._pull.close(0)
            self._close_sockets()

    def _queue(self, peer, msg, arrived_at: float) -> None:
        """Hand a message to the engine thread, waking it if it sleeps (an idle P must still AbortAck)."""
        self.inbox.put((peer, msg, arrived_at))
        if self.wakeup is not None:
            self.wakeup()

    def _wait_s(self) -> float:
        return CONTROL_TICK_S

    def _peer_sockets(self) -> list[tuple[zmq.Socket, bytes | None]]:
        """(socket, the peer it talks to, or None for a ROUTER) for every peer-facing socket."""
        raise NotImplementedError

    def _on_peer(self, sock: zmq.Socket, peer: bytes, msg, arrived_at: float) -> None:
        raise NotImplementedError

    def _deliver(self, peer: bytes, frames: list, end_room: int | None) -> None:
        raise NotImplementedError

    def _on_command(self, frames: list[bytes]) -> None:
        pass

    def _tick(self, now: float) -> None:
        pass

    def _close_sockets(self) -> None:
        pass



@dataclass(frozen=True)
class BootstrapInfo:
    """The router's injected fields: where P's bootstrap server is, and the room that pairs P and D."""

    host: str
    port: int
    room: int

    @classmethod
    def from_body(cls, body: dict) -> "BootstrapInfo":
        for name, kind in (("bootstrap_host", str), ("bootstrap_port", int), ("bootstrap_room", int)):
            if not isinstance(body.get(name), kind) or isinstance(body.get(name), bool):
                raise InvalidRequest(name, f"a {kind.__name__} is required on a prefill/decode server "
                                     f"(send requests through `specpd serve --role router`)")
        return cls(body["bootstrap_host"], body["bootstrap_port"], body["bootstrap_room"])


def draft_mode(config) -> str:
    """PeerConfig.draft_mode: where the draft extend over the prompt runs (messages.DRAFT_MODES): the
    configured `--draft-mode` as spelled there, or "none" without a draft model (no speculation, or a
    model-free drafter, which keeps no per-prompt state to hand over)."""
    spec = config.spec
    if not spec.enabled or spec.model_free:
        return "none"
    return spec.draft_mode


def peer_config(engine, transfer_backend: str) -> PeerConfig:
    from specpd.grammar import backend_id
    from specpd.kv.latent_pool import model_wire_layout
    cfg = engine.config
    mode, spec = draft_mode(cfg), cfg.spec
    return PeerConfig(model=cfg.model, draft_model=spec.draft_model, page_size=cfg.cache.page_size,
                      dtype=cfg.dtype, spec_algorithm=spec.speculative_algorithm, draft_mode=mode,
                      transfer_backend=transfer_backend, grammar_backend=backend_id(),
                      draft_shape=f"{spec.num_steps},{spec.topk},{spec.num_draft_tokens}" if mode == "both" else "",
                      tp_size=cfg.tp_size, kv_heads=engine.model_config.num_kv_heads,
                      # an MLA model's pages hold latent rows (specpd/kv/latent_pool.py)
                      kv_layout=model_wire_layout(engine.model_config) or KV_LAYOUT)


class DisaggWorker:
    role = "worker"

    def __init__(self, engine, transfer_backend: str, host: str = "127.0.0.1", advertise_host: str | None = None):
        """`host`: the address this server's control and transfer sockets bind; `advertise_host`: the one its
        peers are told (default: host) — a server bound to 0.0.0.0, or behind NAT, names a reachable one."""
        self.engine = engine
        self.transfer_backend = transfer_backend
        self.host = host
        self.advertise_host = advertise_host or host
        self.config = engine.config
        self.tokenizer = engine.tokenizer
        self.model_name = engine.model_name
        self.max_model_len = engine.max_model_len
        self.peer_config = peer_config(engine, transfer_backend)
        # every tensor-parallel rank's transfer endpoint (rank 0's backend is self.backend)
        self.kv = KVTransfers(engine, transfer_backend, host, self.advertise_host, self.peer_config.draft_mode)
        self.backend = self.kv.backend
        self.ctx = zmq.Context.instance()
        self.control: ControlThread | None = None  # the subclass builds and starts it
        self.step_started: float | None = None  # monotonic start of the engine step running now (for load)
        self.last_step: tuple[float, float] = (0.0, 0.0)  # monotonic start and end of the last engine step
        self.steps_done = 0  # engine steps finished (P's heartbeat reports it as progress)
        self.engine_failed = False  # step() raised: the engine thread is gone (busy is not dead; this is)
        self._expected: dict[str, tuple[BootstrapInfo, float]] = {}  # request id -> (room, monotonic arrival)
        self.stages = StageStats()  # the TTFT breakdown (timeline.py), observed as each room's stages end
        self._returned_early = False  # the last step() returned the stages' outputs without a forward
        self._lock = threading.Lock()
        self._outputs: list[RequestOutput] = []  # produced by the disagg stages, returned by the next step

    # -- loop thread -----------------------------------------------------------------------
    def expect(self, request_id: str, info: BootstrapInfo, received_at: float | None = None) -> None:
        """`received_at`: when the HTTP handler read the request (monotonic; now if not given)."""
        with self._lock:
            self._expected[request_id] = (info, time.monotonic() if received_at is None else received_at)

    def _take_expected(self, request_id: str) -> tuple[BootstrapInfo, float]:
        with self._lock:
            expected = self._expected.pop(request_id, None)
        if expected is None:
            raise InvalidRequest("bootstrap_room", "missing (send requests through the router)")
        return expected

    # -- engine thread: the LLMEngine interface --------------------------------------------
    @property
    def free_pages(self) -> int:
        return self.engine.free_pages

    @property
    def total_pages(self) -> int:
        return self.engine.total_pages

    def flush_cache(self) -> int:
        return self.engine.flush_cache()

    def stats(self) -> dict:
        return {**self.engine.stats(), **self.queue_sizes(), "transfer_backend": self.transfer_backend,
                "peer_config": dataclasses.asdict(self.peer_config)}

    def queue_sizes(self) -> dict:
        return {}

    def disagg_busy(self) -> bool:
        return False

    def dead_ranks(self) -> list[int]:
        return self.engine.dead_ranks()

    def has_unfinished_requests(self) -> bool:
        return (self.engine.has_unfinished_requests() or self.disagg_busy() or bool(self._outputs)
                or not self.control.inbox.empty())

    def set_wakeup(self, wakeup) -> None:
        """`wakeup()` (thread-safe) makes the driver call step() soon; the control thread calls it per message."""
        self.control.wakeup = wakeup

    def step(self) -> list[RequestOutput]:
        try:
            return self._step()
        except BaseException:  # the engine thread dies with this: P's control thread falls silent
            self.engine_failed = True
            raise

    def _step(self) -> list[RequestOutput]:
        """Peer messages, the stages, then one engine forward, then the stages again. What the stages produce
        before the forward (D: a committed handoff's y0, a failed room's error) leaves at once, without
        waiting for that forward; never twice in a row, so the forward is not starved."""
        self._take_messages(0.0)
        self.advance()
        early = self._take_outputs()
        if early and not self._returned_early:
            self._returned_early = True
            return early
        self._returned_early = False
        outputs = []
        if self.engine.has_unfinished_requests():
            self.step_started = time.monotonic()
            try:
                outputs = self.engine.step()
            finally:
                self.last_step = (self.step_started, time.monotonic())
                self.step_started = None
                self.steps_done += 1
        else:  # nothing to compute: wait a moment for a peer's message rather than spin
            self._take_messages(IDLE_POLL_S)
        outputs = self.on_engine_outputs(outputs)
        self.advance()
        return early + self._take_outputs() + outputs

    def _take_messages(self, timeout_s: float) -> None:
        for peer, msg, arrived_at in self.control.take(timeout_s):
            self.on_message(peer, msg, arrived_at)

    def _take_outputs(self) -> list[RequestOutput]:
        outputs, self._outputs = self._outputs + self.engine.take_pending_outputs(), []
        return outputs

    def on_message(self, peer: bytes, msg, arrived_at: float) -> None:
        """A peer message the control thread queued for the engine thread."""
        raise NotImplementedError

    def on_engine_outputs(self, outputs: list[RequestOutput]) -> list[RequestOutput]:
        return outputs

    def advance(self) -> None:
        pass

    def close(self) -> None:
        if self.control is not None:
            self.control.close()
        self.kv.close()

    def _final(self, request_id: str, num_prompt_tokens: int, reason: str, error: str | None = None,
               token_ids: list[int] | None = None) -> None:
        ids = token_ids or []
        self._outputs.append(RequestOutput(request_id, ids, "", ids, "", True, reason, num_prompt_tokens,
                                           error=error))
