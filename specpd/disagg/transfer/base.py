"""The data plane: move whole KV pages from this process's pools into a peer's pools.

1. Each side builds one backend and `register`s its page pools once (target KV, then draft KV): each a
   contiguous tensor `[num_pages, ...]` whose page i is one contiguous block of `page_bytes`.
2. D publishes `session_id` and `layouts` (in `KVDestination`); P keeps nothing else about D.
3. P calls `submit(peer_session, src_page_ids, dst_page_ids, peer_layouts, runs)`: for every page pair
   (`src[i]`, `dst[i]`) and every `Run` (a byte range of a local pool's page -> a byte range of a peer pool's
   page, specpd/disagg/kv_layout.py plans them from both sides' head ranges), one descriptor. Without `runs`:
   page `src[i]` of every local pool j into the prefix of page `dst[i]` of the peer's pool j. Descriptors are
   sent in calls of at most `max_descriptors_per_call` (Mooncake's TCP transport rejects more than its
   per-peer queue, 1024 by default), calls to one peer never overlap.
4. `TransferHandle.poll()` is PENDING until every call returned, then DONE or FAILED (with `error`).
   `transfer()` is submit + wait.
5. A failure after descriptors were submitted may leave writes in flight: Mooncake fails a batch at its
   first failed slice or at its timeout while the other slices go on (measured: every page of a batch that
   timed out on a SIGSTOPped peer landed once the peer resumed). `quiescent(peer)` turns true `drain_s`
   after the last failed submit, enough for a live peer; for a frozen one nothing on P's side can promise
   it, so D keeps the destination pages of a failed room until AbortAck or its own hard timeout.
"""
from __future__ import annotations

import enum
import threading
import time
from abc import ABC, abstractmethod
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import ClassVar, Sequence

import torch

from specpd.disagg.messages import PoolLayout


class TransferError(RuntimeError):
    """A page transfer failed; the message names the peer and the cause."""


class PeerUnreachable(TransferError):
    """The peer's transfer endpoint refused or never answered the connection (dead peer)."""


class TransferStatus(enum.Enum):
    PENDING = "pending"
    DONE = "done"
    FAILED = "failed"


@dataclass(frozen=True)
class Run:
    """A byte range of every page of local pool `src_pool` -> the same length in the peer's pool `dst_pool`."""

    src_pool: int
    src_offset: int
    dst_pool: int
    dst_offset: int
    num_bytes: int


@dataclass(frozen=True)
class PageCopy:
    """One descriptor: `run`'s bytes of local page `src_page` -> the peer's page `dst_page`."""

    run: Run
    src_page: int
    dst_page: int

    @property
    def pool(self) -> int:
        return self.run.src_pool


@dataclass(frozen=True)
class TransferResult:
    status: TransferStatus
    num_pages: int  # pages per pool requested
    num_bytes: int  # bytes written (all pools), 0 on failure
    num_calls: int  # backend calls the descriptors were split into
    elapsed_s: float
    error: str | None = None
    num_descriptors: int = 0  # contiguous blocks written (requested, on failure)

    @property
    def ok(self) -> bool:
        return self.status is TransferStatus.DONE


class TransferHandle:
    """A submitted transfer: poll without blocking, or wait."""

    def __init__(self, future: Future):
        self._future = future

    def poll(self) -> TransferStatus:
        if not self._future.done():
            return TransferStatus.PENDING
        return self._future.result().status

    def wait(self, timeout: float | None = None) -> TransferResult | None:
        """The result, or None if still pending after `timeout` seconds."""
        try:
            return self._future.result(timeout)
        except TimeoutError:
            return None

    def on_done(self, callback) -> None:
        """callback(TransferResult) once the transfer ended (at once if it has)."""
        self._future.add_done_callback(lambda f: callback(f.result()))


class TransferBackend(ABC):
    """ABC of the transfer engines; see the module docstring for the lifecycle."""

    name: ClassVar[str]

    def __init__(self, host: str = "127.0.0.1", *, advertise_host: str | None = None,
                 max_descriptors_per_call: int = 512, timeout_s: float = 30.0, drain_s: float = 1.0,
                 num_workers: int = 2):
        """`host`: the address this engine binds; `advertise_host`: the one peers reach it at (default: host)."""
        if max_descriptors_per_call < 1:
            raise ValueError(f"max_descriptors_per_call must be >= 1, got {max_descriptors_per_call}")
        self.host = host
        self.advertise_host = advertise_host or host
        self.max_descriptors_per_call = max_descriptors_per_call
        self.timeout_s = timeout_s
        self.drain_s = drain_s
        self._pools: list[torch.Tensor] = []  # each [num_pages, ...], viewed as uint8 [num_pages, page_bytes]
        self._layouts: list[PoolLayout] = []
        self._peer_locks: dict[str, threading.Lock] = {}
        self._unsafe_until: dict[str, float] = {}  # peer -> monotonic time its failed writes surely drained
        self._lock = threading.Lock()
        self._executor = ThreadPoolExecutor(max_workers=num_workers, thread_name_prefix=f"specpd-{self.name}")
        self._closed = False
        self._start_workers(num_workers)

    def _start_workers(self, n: int) -> None:
        """Start the writer threads now, from the constructing thread, so they keep its scheduling
        policy: the pool would otherwise spawn them from the first caller of submit (the engine
        thread, which a server may have put in SCHED_IDLE)."""
        barrier = threading.Barrier(n + 1)
        for _ in range(n):
            self._executor.submit(barrier.wait)
        barrier.wait()

    # -- the backend-specific part

    @classmethod
    def check_available(cls) -> None:
        """Raise ImportError naming the fix if this backend cannot run on this machine."""

    @property
    @abstractmethod
    def session_id(self) -> str:
        """What a peer passes as `peer_session` to write into this process's pools."""

    @abstractmethod
    def _register_pool(self, pool_bytes: torch.Tensor) -> int:
        """Make `pool_bytes` (uint8 [num_pages, page_bytes]) writable by peers; returns the base address
        peers use (0 when the backend addresses pools by index)."""

    @abstractmethod
    def _write(self, peer_session: str, copies: Sequence[PageCopy], peer_layouts: Sequence[PoolLayout],
               deadline: float) -> None:
        """Write `copies` (at most max_descriptors_per_call) to the peer; raise TransferError on failure.
        Called with the peer's lock held: no other call to this peer runs meanwhile."""

    def _close(self) -> None:
        pass

    # -- common part

    def register(self, pools: Sequence[torch.Tensor]) -> list[PoolLayout]:
        """Register page pools (pool j of both peers must have the same page size). Call once, before use."""
        if self._pools:
            raise RuntimeError(f"{self.name}: pools already registered")
        for j, pool in enumerate(pools):
            if not pool.is_contiguous() or pool.dim() < 1 or pool.shape[0] < 1:
                raise ValueError(f"pool {j} must be a contiguous [num_pages, ...] tensor, got shape "
                                 f"{tuple(pool.shape)} contiguous={pool.is_contiguous()}")
            pool_bytes = pool.view(-1).view(torch.uint8).view(pool.shape[0], -1)  # [num_pages, page_bytes]
            base = self._register_pool(pool_bytes)
            self._pools.append(pool_bytes)
            self._layouts.append(PoolLayout(base_address=base, page_bytes=pool_bytes.shape[1],
                                            num_pages=pool_bytes.shape[0]))
        return list(self._layouts)

    @property
    def layouts(self) -> tuple[PoolLayout, ...]:
        return tuple(self._layouts)

    def submit(self, peer_session: str, src_page_ids: Sequence[int], dst_page_ids: Sequence[int],
               peer_layouts: Sequence[PoolLayout], runs: Sequence[Run] | None = None) -> TransferHandle:
        """Validate now (raises ValueError), write in a worker thread. `runs`: None = whole local pages."""
        if self._closed:
            raise RuntimeError(f"{self.name}: backend is closed")
        src, dst = [int(p) for p in src_page_ids], [int(p) for p in dst_page_ids]
        if runs is None:
            runs = [Run(j, 0, j, 0, layout.page_bytes) for j, layout in enumerate(self._layouts)]
        self._validate(src, dst, peer_layouts, runs)
        copies = [PageCopy(run, s, d) for run in runs for s, d in zip(src, dst)]
        return TransferHandle(self._executor.submit(self._run, peer_session, copies, len(src), peer_layouts))

    def transfer(self, peer_session: str, src_page_ids: Sequence[int], dst_page_ids: Sequence[int],
                 peer_layouts: Sequence[PoolLayout], runs: Sequence[Run] | None = None) -> TransferResult:
        return self.submit(peer_session, src_page_ids, dst_page_ids, peer_layouts, runs).wait()

    def quiescent(self, peer_session: str) -> bool:
        """True when no write of ours into a live peer can still land (module docstring, step 5)."""
        return time.monotonic() >= self._unsafe_until.get(peer_session, 0.0)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._executor.shutdown(wait=True)
        self._close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def _validate(self, src: list[int], dst: list[int], peer_layouts: Sequence[PoolLayout],
                  runs: Sequence[Run]) -> None:
        if not self._pools:
            raise RuntimeError(f"{self.name}: register pools before transferring")
        if len(src) != len(dst):
            raise ValueError(f"{len(src)} source pages but {len(dst)} destination pages")
        for run in runs:
            if not (0 <= run.src_pool < len(self._layouts) and 0 <= run.dst_pool < len(peer_layouts)):
                raise ValueError(f"run {run}: this side has {len(self._layouts)} pools, the peer {len(peer_layouts)}")
            mine, theirs = self._layouts[run.src_pool], peer_layouts[run.dst_pool]
            if run.num_bytes < 1 or min(run.src_offset, run.dst_offset) < 0 \
                    or run.src_offset + run.num_bytes > mine.page_bytes \
                    or run.dst_offset + run.num_bytes > theirs.page_bytes:
                raise ValueError(f"run {run} does not fit the pages (local pool {run.src_pool}: {mine.page_bytes} B, "
                                 f"the peer's pool {run.dst_pool}: {theirs.page_bytes} B): local pages larger "
                                 f"than the peer's?")
            bad_src = [p for p in src if not 0 <= p < mine.num_pages]
            bad_dst = [p for p in dst if not 0 <= p < theirs.num_pages]
            if bad_src or bad_dst:
                raise ValueError(f"pool {run.src_pool}: page ids out of range: src {bad_src[:4]} (local has "
                                 f"{mine.num_pages}), dst {bad_dst[:4]} (peer has {theirs.num_pages})")
        if len(set(dst)) != len(dst):
            raise ValueError("destination page ids repeat")

    def _run(self, peer_session: str, copies: list[PageCopy], num_pages: int,
             peer_layouts: Sequence[PoolLayout]) -> TransferResult:
        start = time.monotonic()
        deadline = start + self.timeout_s
        step = self.max_descriptors_per_call
        num_calls = 0
        with self._lock:
            peer_lock = self._peer_locks.setdefault(peer_session, threading.Lock())
        try:
            with peer_lock:
                for i in range(0, len(copies), step):
                    if time.monotonic() > deadline:
                        raise TransferError(f"{self.name}: transfer to {peer_session} timed out after "
                                            f"{self.timeout_s:.1f} s ({i}/{len(copies)} pages written)")
                    num_calls += 1
                    self._write(peer_session, copies[i:i + step], peer_layouts, deadline)
        except Exception as e:  # noqa: BLE001 - a transfer failure is a result, never a crash of the worker
            if num_calls and not isinstance(e, PeerUnreachable):
                self._unsafe_until[peer_session] = time.monotonic() + self.drain_s
            error = str(e) if isinstance(e, TransferError) else f"{self.name}: {type(e).__name__}: {e}"
            return TransferResult(TransferStatus.FAILED, num_pages, 0, num_calls, time.monotonic() - start, error,
                                  len(copies))
        num_bytes = sum(c.run.num_bytes for c in copies)
        return TransferResult(TransferStatus.DONE, num_pages, num_bytes, num_calls, time.monotonic() - start,
                              num_descriptors=len(copies))
