"""The bridge between the asyncio HTTP server and the (not thread-safe) LLMEngine.

One dedicated thread owns the engine. A request passes through:
  1. `submit` (event loop): refuses it with QueueFullError (HTTP 503) when `max_queued` requests already
     wait for their first token; registers a RequestStream, puts an "add" command in the inbox and
     awaits admission; `add_request`'s InvalidRequest comes back here and becomes an HTTP 400.
  2. The engine thread drains the inbox (add / abort), then `step()`s while work exists and
     blocks on the inbox when idle.
  3. Each step's outputs go back to the loop in one `call_soon_threadsafe`; `_dispatch` routes
     them to their streams' asyncio queues and records metrics.
  4. The final output (finish_reason stop / length / abort) closes the stream. A handler that
     leaves early (client gone) calls `abort`; the engine frees the pages at its next step.
torch releases the GIL during kernels, so the loop stays responsive while the engine runs.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import os
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Any, AsyncIterator

from specpd.core import RequestOutput, SamplingParams

logger = logging.getLogger(__name__)


RANK_WATCH_S = 0.5  # how often a tensor-parallel server checks its ranks' processes
RANK_EXIT_GRACE_S = 1.0  # from a dead rank's requests failing to the process exiting


class EngineDeadError(RuntimeError):
    """The engine thread hit an exception in step(); the server can no longer generate."""


class QueueFullError(RuntimeError):
    """Too many requests wait for their first token; the client should retry after `retry_after_s`."""

    def __init__(self, num_queued: int, retry_after_s: int = 1):
        super().__init__(f"server busy: {num_queued} requests already wait for their first token "
                         f"(--max-queued-requests); retry after {retry_after_s} s")
        self.retry_after_s = retry_after_s


@dataclass
class RequestStream:
    """The loop-side end of one request: its outputs, in order, and its timings."""

    request_id: str
    num_prompt_tokens: int
    arrival: float = field(default_factory=time.monotonic)
    first_token_time: float | None = None
    finished: bool = False
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)

    async def __aiter__(self) -> AsyncIterator[RequestOutput]:
        while True:
            item = await self.queue.get()
            if isinstance(item, BaseException):
                raise item
            yield item
            if item.finished:
                return


@dataclass
class _Add:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    admitted: asyncio.Future
    follows: str | None = None  # a parallel sample after the first: that one's request id


@dataclass
class _Abort:
    request_id: str


@dataclass
class _Call:
    """Run `fn(engine)` on the engine thread between steps (e.g. flush_cache); its result resolves `done`."""
    fn: Any
    done: asyncio.Future


_STOP = object()
_WAKE = object()  # a PD worker's control thread queued a peer message: step even if no request is live
ENGINE_PRIORITIES = ("normal", "low")


def lower_thread_priority() -> bool:
    """Put the calling thread (and the threads it starts later, e.g. OpenMP workers) in SCHED_IDLE:
    it runs only when no normal thread on its core wants to. False where the OS refuses."""
    try:
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))  # pid 0 = this thread on Linux
    except (AttributeError, OSError) as e:
        logger.warning("engine priority low: SCHED_IDLE refused (%s); the engine thread keeps its priority", e)
        return False
    return True


class EngineThread:
    """The engine's thread: build the engine on it (`run(build)`), then hand it to AsyncEngine, which runs the
    engine loop there. One thread runs every torch op: a second thread that ran one (the main thread loading
    the model) keeps an OpenMP team of its own, and with more OpenMP threads than cores libgomp's workers stop
    spinning between parallel regions, so every GEMM waits for a futex wake (a decode step nearly doubles, and
    the cost model, timed on the main thread, would not know).
    A daemon, like the loop's thread always was: a wedged step never holds the interpreter's exit."""

    def __init__(self, priority: str = "normal"):
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._priority = priority
        threading.Thread(target=self._serve, name="specpd-engine", daemon=True).start()

    def submit(self, fn, *args) -> concurrent.futures.Future:
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._jobs.put((future, fn, args))
        return future

    def run(self, fn, *args):
        """fn(*args) on the engine thread; its result (or exception) here."""
        return self.submit(fn, *args).result()

    def _serve(self) -> None:
        if self._priority == "low":
            lower_thread_priority()
        while True:
            future, fn, args = self._jobs.get()
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(fn(*args))
                except BaseException as exc:  # noqa: BLE001 - the caller gets it
                    future.set_exception(exc)


class AsyncEngine:
    def __init__(self, engine, metrics=None, priority: str = "normal", max_queued: int | None = None,
                 thread: EngineThread | None = None):
        """priority "low": the engine thread runs under SCHED_IDLE (Linux), so the HTTP thread and the KV
        transfer threads of this process run the moment they wake instead of after the engine's time
        slice. On a CPU box where a server owns one core, a KV write otherwise waits for the scheduler at
        every TCP round trip, and a transfer between two busy cores runs at a fraction of its rate.
        max_queued: requests that may wait for their first token (queued for a batch slot, for KV, or in
        prefill) before `submit` refuses more; None: no limit.
        thread: the EngineThread the engine was built on, to run the engine loop (every torch op of the
        process on one thread: one OpenMP team); it was started with `priority`. None: a thread of its own."""
        if max_queued is not None and max_queued < 1:
            raise ValueError(f"max_queued must be >= 1 or None, got {max_queued}")
        if priority not in ENGINE_PRIORITIES:
            raise ValueError(f"engine priority must be one of {ENGINE_PRIORITIES}, got {priority!r}")
        self.engine = engine
        self.metrics = metrics  # ServerMetrics or None
        self.priority = priority
        self.max_queued = max_queued
        self.error: BaseException | None = None
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._streams: dict[str, RequestStream] = {}  # loop thread only
        self._live: set[str] = set()  # engine thread only: admitted, not yet finished
        self._stats: dict[str, Any] = engine.stats()  # replaced (never mutated) by the engine thread
        self._loop: asyncio.AbstractEventLoop | None = None
        self._on_first_token = getattr(engine, "on_first_token", None)  # (request id, monotonic time), loop thread
        self._thread = thread
        self._running: concurrent.futures.Future | None = None

    # -- lifecycle (loop thread) -----------------------------------------------------------
    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        if hasattr(self.engine, "set_wakeup"):  # PD workers: peer messages arrive between requests too
            self.engine.set_wakeup(lambda: self._inbox.put(_WAKE))
        if self._thread is None:
            self._thread = EngineThread(self.priority)
        self._running = self._thread.submit(self._run)
        if getattr(getattr(self.engine, "config", None), "tp_size", 1) > 1:
            threading.Thread(target=self._watch_ranks, name="specpd-tp-watch", daemon=True).start()

    def _watch_ranks(self) -> None:
        """A tensor-parallel server whose rank died cannot generate again: its waiting requests get the error,
        then the process exits (1) so that whatever supervises it (`--disagg`'s launcher, systemd, k8s) starts
        a whole new group at once, as vLLM's server does when its engine core dies; an idle server notices too."""
        while not (dead := self.dead_ranks()):
            time.sleep(RANK_WATCH_S)
        logger.error("tensor-parallel rank(s) %s exited: stopping this server", dead)
        self._loop.call_soon_threadsafe(self._fail_all, EngineDeadError(self.why_dead()))
        time.sleep(RANK_EXIT_GRACE_S)  # the failed requests' answers leave first
        os._exit(1)

    def stop(self, timeout: float = 10.0) -> None:
        if self._running is not None and not self._running.done():
            self._inbox.put(_STOP)
            concurrent.futures.wait([self._running], timeout)

    @property
    def alive(self) -> bool:
        return (self._running is not None and not self._running.done() and self.error is None
                and not self.dead_ranks())

    def why_dead(self) -> str:
        dead = self.dead_ranks()
        if self.error is None and dead:
            return f"the engine is not running: its tensor-parallel rank(s) {dead} exited"
        return (f"the engine is not running: it stopped after an internal error ({type(self.error).__name__}); the "
                f"server's log has the details")

    def dead_ranks(self) -> list[int]:
        """The engine's tensor-parallel ranks that exited (read from their process handles, no engine call)."""
        dead = getattr(self.engine, "dead_ranks", None)
        return dead() if dead is not None else []

    def stats(self) -> dict[str, Any]:
        """The engine's stats() as of its last step (read without touching the engine)."""
        return self._stats

    # -- requests (loop thread) ------------------------------------------------------------
    @property
    def num_queued(self) -> int:
        """Requests submitted (or being submitted) that have no output token yet."""
        return sum(1 for s in self._streams.values() if s.first_token_time is None)

    def check_queue(self) -> None:
        """Raise QueueFullError if a new request would exceed `max_queued` (cheap: call before work)."""
        if self.max_queued is not None and (queued := self.num_queued) >= self.max_queued:
            raise QueueFullError(queued)

    async def submit(self, request_id: str, prompt_token_ids: list[int],
                     params: SamplingParams, follows: str | None = None) -> RequestStream:
        """Queue a request; returns once the engine admitted it. Raises InvalidRequest if it didn't.
        follows: the first parallel sample's id, for the others of an n > 1 request (they share its prompt KV)."""
        if not self.alive:
            raise EngineDeadError(self.why_dead())
        self.check_queue()
        stream = RequestStream(request_id, len(prompt_token_ids))
        self._streams[request_id] = stream
        admitted = self._loop.create_future()
        self._inbox.put(_Add(request_id, prompt_token_ids, params, admitted, follows))
        try:
            await admitted
        except asyncio.CancelledError:  # client left while the engine was busy: undo the add
            self.abort(request_id)
            raise
        return stream

    async def call(self, fn) -> Any:
        """`fn(engine)` on the engine thread, between steps; its result (or exception) comes back here."""
        if not self.alive:
            raise EngineDeadError(self.why_dead())
        done = self._loop.create_future()
        self._inbox.put(_Call(fn, done))
        return await done

    def abort(self, request_id: str) -> None:
        """Stop a request early. Its final output (finish_reason "abort") still arrives and is counted."""
        stream = self._streams.get(request_id)
        if stream is not None and not stream.finished:
            self._inbox.put(_Abort(request_id))

    def _dispatch(self, outputs: list[RequestOutput]) -> None:
        now = time.monotonic()
        for out in outputs:
            stream = self._streams.get(out.request_id)
            if stream is None:
                continue
            if stream.first_token_time is None and out.new_token_ids:
                stream.first_token_time = now
                if self.metrics:
                    self.metrics.observe_first_token(now - stream.arrival)
                if self._on_first_token is not None:  # PD decode: the TTFT breakdown's last stage
                    self._on_first_token(out.request_id, now)
            if out.finished:
                stream.finished = True
                del self._streams[out.request_id]
                if self.metrics:
                    self.metrics.observe_finished(stream, out, now)
            stream.queue.put_nowait(out)

    def _reject(self, cmd: _Add, error: Exception) -> None:
        self._streams.pop(cmd.request_id, None)
        _resolve(cmd.admitted, error)

    def _fail_all(self, error: BaseException) -> None:
        for stream in self._streams.values():
            stream.queue.put_nowait(error)
        self._streams.clear()

    # -- the engine thread -----------------------------------------------------------------
    def _run(self) -> None:  # on the EngineThread, which took the priority when it started
        try:
            while True:
                busy = self.engine.has_unfinished_requests()
                if not self._drain_inbox(block=not busy):
                    return
                if self.engine.has_unfinished_requests():
                    outputs = self.engine.step()
                    self._stats = self.engine.stats()
                    if outputs:
                        for out in outputs:
                            if out.finished:
                                self._live.discard(out.request_id)
                        self._loop.call_soon_threadsafe(self._dispatch, outputs)
        except BaseException as exc:  # noqa: BLE001 - the server must report, not hang
            logger.exception("engine thread died")
            self.error = exc
            dead = EngineDeadError(f"the engine failed with an internal error ({type(exc).__name__}); the server's "
                                   f"log has the details")
            self._loop.call_soon_threadsafe(self._fail_all, dead)
            while True:  # answer anything still queued so no handler waits forever
                try:
                    cmd = self._inbox.get_nowait()
                except queue.Empty:
                    return
                if isinstance(cmd, _Add):
                    self._loop.call_soon_threadsafe(_resolve, cmd.admitted, dead)

    def _drain_inbox(self, block: bool) -> bool:
        """Apply queued commands; False when asked to stop."""
        try:
            cmd = self._inbox.get() if block else self._inbox.get_nowait()
        except queue.Empty:
            return True
        while True:
            if cmd is _STOP:
                return False
            if cmd is _WAKE:
                pass
            elif isinstance(cmd, _Call):
                try:
                    result, error = cmd.fn(self.engine), None
                except Exception as exc:  # noqa: BLE001 - the caller gets it
                    result, error = None, exc
                # what the call changed (e.g. /flush_cache's pages) shows in stats before its caller hears back:
                # the caller's next /server_info reads them (a race seen once in CI: 9 cached pages after a flush)
                self._stats = self.engine.stats()
                self._loop.call_soon_threadsafe(_settle, cmd.done, result, error)
            elif isinstance(cmd, _Add):
                try:
                    self.engine.add_request(cmd.request_id, cmd.prompt_token_ids, cmd.params,
                                            **({"follows": cmd.follows} if cmd.follows else {}))
                except Exception as exc:  # noqa: BLE001 - InvalidRequest -> 400, anything else -> 500
                    self._loop.call_soon_threadsafe(self._reject, cmd, exc)
                else:
                    self._live.add(cmd.request_id)
                    self._loop.call_soon_threadsafe(_resolve, cmd.admitted, None)
            elif cmd.request_id in self._live:
                self.engine.abort_request(cmd.request_id)
            try:
                cmd = self._inbox.get_nowait()
            except queue.Empty:
                self._stats = self.engine.stats()
                return True


def _settle(future: asyncio.Future, result: Any, error: BaseException | None) -> None:
    if not future.done():
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(result)


def _resolve(future: asyncio.Future, error: BaseException | None) -> None:
    if future.done():
        return
    if error is None:
        future.set_result(None)
    else:
        future.set_exception(error)
