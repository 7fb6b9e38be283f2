"""PD handoff in one process when something goes wrong: a room in use is refused, a dead prefill server fails
its rooms and frees the pages, a decode server waits only so long and refuses a prefill server whose config or
transfer backend differs."""
import time

import pytest

from specpd.disagg.transfer import backend_available
from tests.disagg.handoff_helpers import GREEDY, PROMPTS, make_engine, make_workers, model_dir  # noqa: F401


def test_duplicate_room_is_refused_and_the_first_owner_finishes(model_dir):
    from specpd.core import InvalidRequest
    from specpd.disagg.decode import DecodeWorker
    from specpd.disagg.worker import BootstrapInfo
    p, d = make_workers(model_dir)
    d2 = DecodeWorker(make_engine(model_dir), "tcp")
    expected = make_engine(model_dir).generate([PROMPTS[1]], GREEDY)[0].token_ids
    try:
        info = BootstrapInfo("127.0.0.1", p.bootstrap.port, 77)
        p.expect("p0", info)
        p.add_request("p0", PROMPTS[1], GREEDY)
        d.bootstrap("d0", info)
        d.add_request("d0", PROMPTS[1], GREEDY)
        p.expect("p1", info)  # the same room again on P: refused, the first request untouched
        with pytest.raises(InvalidRequest, match="room 77 is already in use"):
            p.add_request("p1", PROMPTS[0], GREEDY)
        d.bootstrap("d1", info)  # ... and on D
        with pytest.raises(InvalidRequest, match="room 77 is already in use"):
            d.add_request("d1", PROMPTS[0], GREEDY)
        d.step()  # D registers room 77 with P first
        p.step()
        d2.bootstrap("x0", info)  # a second decode server claims the same room: P refuses it
        d2.add_request("x0", PROMPTS[0], GREEDY)
        final, deadline = {}, time.monotonic() + 30
        while (p.has_unfinished_requests() or d.has_unfinished_requests() or d2.has_unfinished_requests()) \
                and time.monotonic() < deadline:
            for worker in (p, d, d2):
                for out in worker.step():
                    if out.finished:
                        final[out.request_id] = out
        assert final["x0"].finish_reason == "abort" and "already in use" in final["x0"].error
        assert final["p0"].finish_reason == "handoff" and final["d0"].error is None
        assert final["d0"].token_ids == expected
        assert p.free_pages == d.free_pages == d2.free_pages == 64
    finally:
        for w in (p, d, d2):
            w.close()


def test_a_dead_prefill_fails_its_rooms_fast_and_frees_the_pages(model_dir):
    """P gone (its bootstrap port refuses): after the heartbeat timeout the client gets an error and the
    pages come back at once, with no wait for the abort timeout."""
    from specpd.disagg.worker import BootstrapInfo
    p, d = make_workers(model_dir, heartbeat_timeout_s=0.5, abort_timeout_s=600)
    try:
        info = BootstrapInfo("127.0.0.1", p.bootstrap.port, 9)
        d.bootstrap("d0", info)
        d.add_request("d0", PROMPTS[1], GREEDY)  # P never gets its half: D waits for the handoff
        d.step()
        assert d.free_pages < 64 and d.queue_sizes()["pd_transfer"] == 1
        p.close()
        start, outs = time.monotonic(), []
        while d.has_unfinished_requests() and time.monotonic() - start < 10:
            outs += d.step()
        assert time.monotonic() - start < 3
        assert [o.finish_reason for o in outs] == ["abort"] and "is gone" in outs[0].error
        assert d.free_pages == 64
    finally:
        d.close()


def test_waiting_for_prefill_times_out(model_dir):
    """P alive but idle and the room never prefilled (P never got its request): no progress for prefill_timeout_s,
    the client hears; the pages follow once P confirms nothing is in flight (here: P's bootstrap-timeout
    TransferFailed for the registration whose request never came)."""
    from specpd.disagg.worker import BootstrapInfo
    p, d = make_workers(model_dir, prefill_timeout_s=0.5)
    p.bootstrap_timeout_s = 1.0
    try:
        info = BootstrapInfo("127.0.0.1", p.bootstrap.port, 10)
        d.bootstrap("d0", info)
        d.add_request("d0", PROMPTS[1], GREEDY)
        start, outs = time.monotonic(), []
        while (d.has_unfinished_requests() or p.has_unfinished_requests()) and time.monotonic() - start < 10:
            outs += d.step()
            p.step()
        assert [o.finish_reason for o in outs] == ["abort"], outs
        assert "prefill of room 10 made no progress for" in outs[0].error and "--pd-prefill-timeout 0.5 s" in outs[0].error
        assert d.free_pages == 64 and p.free_pages == 64
    finally:
        p.close()
        d.close()


def test_decode_refuses_a_mismatched_prefill(model_dir):
    from specpd.core import InvalidRequest
    from specpd.disagg.decode import DecodeWorker
    from specpd.disagg.prefill import PrefillWorker
    from specpd.disagg.worker import BootstrapInfo
    p = PrefillWorker(make_engine(model_dir, page_size=8), "tcp", bootstrap_port=0)  # 0: the OS picks (no race)
    d = DecodeWorker(make_engine(model_dir, page_size=4), "tcp")
    try:
        with pytest.raises(InvalidRequest, match="page_size: prefill=8 decode=4"):
            d.bootstrap("d0", BootstrapInfo("127.0.0.1", p.bootstrap.port, 7))
    finally:
        p.close()
        d.close()


def test_abort_with_a_dead_prefill_frees_after_the_hard_timeout(model_dir):
    from specpd.disagg.decode import DecodeWorker
    from specpd.disagg.prefill import PrefillWorker
    from specpd.disagg.worker import BootstrapInfo
    p = PrefillWorker(make_engine(model_dir), "tcp", bootstrap_port=0)
    d = DecodeWorker(make_engine(model_dir), "tcp", abort_timeout_s=0.2)
    try:
        d.bootstrap("d0", BootstrapInfo("127.0.0.1", p.bootstrap.port, 5))
        p.close()  # P dies before it ever sees the room
        d.add_request("d0", PROMPTS[1], GREEDY)
        d.step()
        assert d.free_pages < 64 and d.queue_sizes()["pd_transfer"] == 1
        d.abort_request("d0")
        outs, deadline = [], time.monotonic() + 5
        while d.has_unfinished_requests() and time.monotonic() < deadline:
            outs += d.step()
        assert [o.finish_reason for o in outs] == ["abort"] and d.free_pages == 64
    finally:
        d.close()


@pytest.mark.skipif(not backend_available("mooncake")[0], reason="mooncake does not load here")
def test_decode_refuses_a_prefill_on_another_transfer_backend(model_dir):
    """P on tcp, D on mooncake: refused at bootstrap (PeerConfig), both names in the error, no room opened."""
    from specpd.core import InvalidRequest
    from specpd.disagg.decode import DecodeWorker
    from specpd.disagg.prefill import PrefillWorker
    from specpd.disagg.worker import BootstrapInfo
    p = PrefillWorker(make_engine(model_dir), "tcp", bootstrap_port=0)
    d = DecodeWorker(make_engine(model_dir), "mooncake")
    try:
        with pytest.raises(InvalidRequest, match="transfer_backend: prefill='tcp' decode='mooncake'"):
            d.bootstrap("d0", BootstrapInfo("127.0.0.1", p.bootstrap.port, 8))
        assert d.free_pages == 64 and not d.has_unfinished_requests()
    finally:
        p.close()
        d.close()
