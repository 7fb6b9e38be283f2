"""A PD server's transfer endpoints, one per tensor-parallel rank, and P's writes through them
(docs/architecture.md §4).

Every rank registers the KV it holds with a transfer engine of its own: rank 0 here (its shard of the target's
pages, and the draft's own pool where the draft has one), ranks 1.. in their worker processes
(`_start_rank`, through `TPModel.call`). D's `KVDestination` lists every D rank's endpoint with what its pools hold
(`KVEndpoint`); P plans which of its ranks writes which runs into which D rank (kv_layout.plan, cached per
destination layout) and submits each P rank's part on that rank. A room's `RoomTransfer` is done when every
part is, and failed when any failed, only once every other part has ended too: P frees its pages and answers
D (TransferDone / TransferFailed / AbortAck) with no write of any rank still in flight.
"""
from __future__ import annotations

import dataclasses
import time

from specpd.disagg.kv_layout import plan, pool_placements
from specpd.disagg.messages import KVDestination, KVEndpoint
from specpd.disagg.transfer import TransferResult, TransferStatus, create_backend

START_TIMEOUT_S = 60.0  # a worker rank's transfer engine up and its pool registered


def _draft_kv(engine):
    """The draft model's KV pool (its own, or its layers of the target's pages), None without a draft model."""
    from specpd.spec.draft.hybrid import HybridProposer
    proposer = engine.spec_runner.proposer if engine.spec_runner else None
    if isinstance(proposer, HybridProposer):
        proposer = proposer.model
    return getattr(proposer, "pool", None)


class KVTransfers:
    """This server's endpoints (`endpoints[r]`: rank r's) and, on P, `submit`."""

    def __init__(self, engine, backend: str, host: str, advertise_host: str, draft_mode: str):
        runner, mc = engine.runner, engine.model_config
        self.backend = create_backend(backend, host, advertise_host=advertise_host)
        pools = [runner.kv_pool]
        placements = pool_placements(runner.kv_pool, 0, 0, 0)  # and the draft's layers in its pages
        draft = _draft_kv(engine)
        if draft is not None and draft.parent is None and draft_mode == "both":  # a draft with a pool of its own
            pools.append(draft)
            placements += pool_placements(draft, 1, 0, mc.num_layers)
        layouts = self.backend.register([p.storage for p in pools])
        self.endpoints = [KVEndpoint(0, self.backend.session_id, tuple(layouts), tuple(placements))]
        self.tp = runner.tp
        if self.tp is not None:
            heads = runner.kv_pool.kv_heads
            calls = [self.tp.call(rank, _start_rank, backend, host, advertise_host)
                     for rank in range(1, runner.config.tp_size)]
            for rank, call in enumerate(calls, start=1):
                if not call.wait(START_TIMEOUT_S) or isinstance(call.value, Exception):
                    raise RuntimeError(f"tensor-parallel rank {rank} could not start its transfer engine: "
                                       f"{call.value if call.done else 'no answer'}")
                session, rank_layouts = call.value
                where = pool_placements(runner.kv_pool, 0, rank * heads, 0)  # every shard has rank 0's shape
                self.endpoints.append(KVEndpoint(rank, session, tuple(rank_layouts), tuple(where)))
        # what moves: the target's layers, and the draft's when P ran the draft extend (draft-on-both)
        self.layers = range(mc.num_layers + (draft.num_layers if draft is not None and draft_mode == "both" else 0))
        self._plans: dict = {}

    def plan(self, dest: KVDestination) -> dict:
        """{(P rank, D rank): runs} for `dest`'s endpoints (kv_layout.plan; LayoutMismatch when they do not fit)."""
        key = tuple(ep.placements for ep in dest.endpoints)
        if key not in self._plans:
            self._plans[key] = plan([ep.placements for ep in self.endpoints], list(key), self.layers)
        return self._plans[key]

    def submit(self, dest: KVDestination, src: list[int], dst: list[int]) -> "RoomTransfer":
        """Pages `src` here -> pages `dst` of `dest`: each P rank's runs on that rank. LayoutMismatch (a ValueError)
        when the sides do not fit; a part refused after others were submitted is a failed part of the room, which
        then fails once those ended (never with a write still in flight)."""
        parts = []
        for (p_rank, d_rank), runs in sorted(self.plan(dest).items()):
            ep = dest.endpoints[d_rank]
            if p_rank == 0:
                try:
                    parts.append(self.backend.submit(ep.session, src, dst, ep.pools, runs))
                except ValueError as e:
                    parts.append(Refused(TransferResult(TransferStatus.FAILED, len(src), 0, 0, 0.0,
                                                        f"KV transfer refused: {e}")))
                    break
            else:
                parts.append(RankWrite(self.tp.call(p_rank, _write_rank, ep.session, src, dst, ep.pools, runs),
                                       len(src)))
        return RoomTransfer(parts, len(src))

    def close(self) -> None:
        self.backend.close()  # the workers' engines close with their processes


def _start_rank(state, done, backend: str, host: str, advertise_host: str) -> None:
    """On a worker rank (TPModel.call): its transfer engine with its KV pool registered -> (session, layouts)."""
    try:
        engine = create_backend(backend, host, advertise_host=advertise_host)
        layouts = engine.register([state.pool.storage])
    except Exception as e:  # noqa: BLE001 - rank 0 raises it, naming this rank
        done(RuntimeError(f"{type(e).__name__}: {e}"))
        return
    state.transfer = engine
    state.on_exit = [*getattr(state, "on_exit", ()), engine.close]
    done((engine.session_id, tuple(layouts)))


def _write_rank(state, done, session: str, src: list[int], dst: list[int], layouts, runs) -> None:
    """On a worker rank: write its runs of pages `src` into the peer's `dst`; the TransferResult (an error naming
    the rank) comes back when the write ends."""
    def report(result: TransferResult) -> None:
        done(result if result.ok else dataclasses.replace(result, error=f"rank {state.rank}: {result.error}"))
    try:
        handle = state.transfer.submit(session, src, dst, layouts, runs)
    except (AttributeError, ValueError, RuntimeError) as e:
        report(TransferResult(TransferStatus.FAILED, len(src), 0, 0, 0.0, f"write refused: {e}"))
        return
    handle.on_done(report)


class RankWrite:
    """A worker rank's write as a TransferHandle (poll / wait) on rank 0."""

    def __init__(self, call, num_pages: int):
        self.call, self.num_pages = call, num_pages

    def poll(self) -> TransferStatus:
        return self._result().status if self.call.ready() else TransferStatus.PENDING

    def wait(self, timeout: float | None = None) -> TransferResult | None:
        return self._result() if self.call.wait(timeout) else None

    def _result(self) -> TransferResult:
        value = self.call.value
        if isinstance(value, Exception):  # the rank died with the write in flight
            return TransferResult(TransferStatus.FAILED, self.num_pages, 0, 0, 0.0, str(value))
        return value


class Refused:
    """A part refused before it wrote anything, as a TransferHandle."""

    def __init__(self, result: TransferResult):
        self.result = result

    def poll(self) -> TransferStatus:
        return TransferStatus.FAILED

    def wait(self, timeout: float | None = None) -> TransferResult:
        return self.result


class RoomTransfer:
    """One submit's parts on every P rank, polled and waited on as one TransferHandle."""

    def __init__(self, parts: list, num_pages: int):
        self.parts, self.num_pages = parts, num_pages

    def poll(self) -> TransferStatus:
        statuses = [part.poll() for part in self.parts]
        if TransferStatus.PENDING in statuses:
            return TransferStatus.PENDING
        return TransferStatus.FAILED if TransferStatus.FAILED in statuses else TransferStatus.DONE

    def wait(self, timeout: float | None = None) -> TransferResult | None:
        deadline = None if timeout is None else time.monotonic() + timeout
        results = []
        for part in self.parts:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            result = part.wait(left)
            if result is None:
                return None
            results.append(result)
        failed = next((r for r in results if not r.ok), None)
        return TransferResult(TransferStatus.FAILED if failed else TransferStatus.DONE, self.num_pages,
                              0 if failed else sum(r.num_bytes for r in results), sum(r.num_calls for r in results),
                              max((r.elapsed_s for r in results), default=0.0), failed.error if failed else None,
                              sum(r.num_descriptors for r in results))


__all__ = ["KVTransfers", "Refused", "RoomTransfer"]
