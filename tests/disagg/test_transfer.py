"""Transfer backends move whole KV pages between two real KVPools, byte-exact, and fail fast on a dead peer."""
import math
import os
import subprocess
import sys
import textwrap
import threading
import time

import pytest
import torch
import zmq

from specpd.disagg.messages import PoolLayout
from specpd.disagg.transfer import TransferStatus, backend_available, create_backend, get_backend_class
from specpd.kv.pool import KVPool

BACKENDS = ["tcp", "mooncake"]
DEAD_PEER = {"tcp": "tcp://127.0.0.1:1", "mooncake": "127.0.0.1:1"}


def _require(name):
    ok, why = backend_available(name)
    if not ok:
        pytest.skip(f"{name} backend cannot load here: {why}")


@pytest.fixture(params=BACKENDS)
def backend_name(request):
    _require(request.param)
    return request.param


@pytest.fixture
def make_backend(backend_name):
    made = []

    def make(**options):
        backend = create_backend(backend_name, "127.0.0.1", **options)
        made.append(backend)
        return backend

    yield make
    for backend in made:
        backend.close()


def _pools(num_pages, dtype, seed=None):
    """A target pool and a draft pool (one layer) sharing page ids, as a decode/prefill server holds them."""
    target = KVPool(num_pages, num_layers=3, page_size=4, kv_heads=2, head_dim=8, dtype=dtype)
    draft = KVPool(num_pages, num_layers=1, page_size=4, kv_heads=2, head_dim=8, dtype=dtype,
                   allocator=target.allocator)
    if seed is not None:
        gen = torch.Generator().manual_seed(seed)
        for pool in (target, draft):
            pool.buffer.copy_(torch.randn(pool.buffer.shape, generator=gen).to(dtype))
    return target, draft


def test_registry():
    assert get_backend_class("tcp").name == "tcp"
    with pytest.raises(ValueError, match="unknown transfer backend 'nixl'"):
        get_backend_class("nixl")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_scattered_pages_arrive_byte_exact(make_backend, dtype):
    p_target, p_draft = _pools(40, dtype, seed=0)
    d_target, d_draft = _pools(64, dtype)
    sender, receiver = make_backend(), make_backend()
    sender.register([p_target.storage, p_draft.storage])
    d_layouts = receiver.register([d_target.storage, d_draft.storage])
    src = [17, 3, 39, 0, 22, 5, 11]
    dst = [63, 8, 0, 41, 2, 30, 9]

    handle = sender.submit(receiver.session_id, src, dst, d_layouts)
    result = handle.wait(timeout=30)
    assert result is not None and result.ok, result
    assert handle.poll() is TransferStatus.DONE
    assert result.num_pages == len(src)
    assert result.num_bytes == len(src) * (p_target.bytes_per_page + p_draft.bytes_per_page)
    for s, d in zip(src, dst):
        for p_pool, d_pool in ((p_target, d_target), (p_draft, d_draft)):
            assert torch.equal(p_pool.buffer[s].view(torch.uint8), d_pool.buffer[d].view(torch.uint8))
    untouched = [p for p in range(64) if p not in dst]
    assert not d_target.buffer[untouched].any() and not d_draft.buffer[untouched].any()
    assert sender.quiescent(receiver.session_id)


@pytest.mark.skipif(not hasattr(os, "SCHED_IDLE"), reason="Linux scheduling policies")
def test_writers_keep_the_policy_of_the_thread_that_built_the_backend(make_backend, backend_name):
    """A server builds its backend, then lowers its engine thread (--engine-priority low) and submits
    from it: the writer threads must exist already and stay at normal priority, or every KV write
    waits behind the engine."""
    from specpd.server.async_engine import lower_thread_priority

    def writers():
        return {t.native_id for t in threading.enumerate() if t.name.startswith(f"specpd-{backend_name}_")}

    p_target, p_draft = _pools(8, torch.float32, seed=0)
    d_target, d_draft = _pools(8, torch.float32)
    sender, receiver = make_backend(), make_backend()
    sender.register([p_target.storage, p_draft.storage])
    d_layouts = receiver.register([d_target.storage, d_draft.storage])
    before = writers()
    assert len(before) == 4  # two per backend, started by the constructor
    done = {}

    def engine_thread():
        assert lower_thread_priority()
        done["result"] = sender.submit(receiver.session_id, [0, 1, 2], [5, 6, 7], d_layouts).wait(timeout=30)

    t = threading.Thread(target=engine_thread)
    t.start()
    t.join()
    assert done["result"].ok
    assert torch.equal(p_target.buffer[:3], d_target.buffer[5:8])
    assert writers() == before and all(os.sched_getscheduler(tid) == os.SCHED_OTHER for tid in before)


def test_runs_move_the_target_block_into_pages_that_also_hold_a_draft(make_backend):
    """A prefill server's target-only pages (draft-on-decode-only) into pages that also hold a draft's layers:
    kv_layout plans one run per page (the target's block starts every page on both sides), and the draft's block
    is never touched."""
    from specpd.disagg.kv_layout import plan, pool_placements
    from specpd.kv.pool import KVPool
    src = KVPool(12, 3, 4, 2, 16, torch.float32)
    src.buffer.copy_(torch.randn(src.buffer.shape))
    dst = KVPool(12, 3, 4, 2, 16, torch.float32, extra_layers=1)  # room for one draft layer per page
    draft = KVPool.layers_of(dst)
    draft.buffer.fill_(7.0)
    runs = plan([pool_placements(src, 0, 0, 0)], [pool_placements(dst, 0, 0, 0)], range(3))[(0, 0)]
    assert [(r.src_offset, r.dst_offset, r.num_bytes) for r in runs] == [(0, 0, src.bytes_per_page)]
    sender, receiver = make_backend(), make_backend()
    sender.register([src.storage])
    layouts = receiver.register([dst.storage])
    result = sender.transfer(receiver.session_id, [5, 0, 11], [1, 9, 4], layouts, runs)
    assert result.ok and result.num_bytes == 3 * src.bytes_per_page and result.num_descriptors == 3, result
    assert torch.equal(dst.buffer[[1, 9, 4]], src.buffer[[5, 0, 11]])
    assert (draft.buffer == 7.0).all()  # the draft's layers are never touched
    untouched = [p for p in range(12) if p not in (1, 9, 4)]
    assert not dst.buffer[untouched].any()
    with pytest.raises(ValueError, match="does not fit the pages"):
        receiver.submit(sender.session_id, [0], [0], sender.layouts)


def test_batches_above_the_per_call_limit_are_split(make_backend):
    p_target, p_draft = _pools(50, torch.float32, seed=1)
    d_target, d_draft = _pools(50, torch.float32)
    sender, receiver = make_backend(max_descriptors_per_call=8), make_backend()
    sender.register([p_target.storage, p_draft.storage])
    layouts = receiver.register([d_target.storage, d_draft.storage])
    dst = list(reversed(range(50)))
    result = sender.transfer(receiver.session_id, list(range(50)), dst, layouts)
    assert result.ok, result
    assert result.num_calls == math.ceil(2 * 50 / 8)  # one descriptor per page per pool
    assert torch.equal(d_target.buffer, p_target.buffer.flip(0))
    assert torch.equal(d_draft.buffer, p_draft.buffer.flip(0))


def test_more_pages_than_the_engine_queue(make_backend):
    """3000 descriptors: one Mooncake TCP call rejects more than 1024 (+1024 admission) per peer."""
    shape = (3000, 1, 2, 4, 1, 32)  # 1 KiB pages
    src_pool, dst_pool = torch.randn(shape), torch.zeros(shape)
    sender, receiver = make_backend(), make_backend()
    sender.register([src_pool])
    layouts = receiver.register([dst_pool])
    result = sender.transfer(receiver.session_id, range(3000), range(3000), layouts)
    assert result.ok, result
    assert result.num_calls == math.ceil(3000 / sender.max_descriptors_per_call) > 1
    assert torch.equal(src_pool, dst_pool)


def test_dead_peer_fails_fast(make_backend, backend_name):
    """A refused connection fails the transfer at once, not at the deadline: with a 60 s deadline (connect
    included), the error names the refusal and comes in well under half of it, however loaded the box."""
    deadline_s = 60.0
    p_target, _ = _pools(8, torch.float32, seed=2)
    connect = {"connect_timeout_s": deadline_s} if backend_name == "tcp" else {}
    sender = make_backend(timeout_s=deadline_s, **connect)
    sender.register([p_target.storage])
    layout = PoolLayout(base_address=1 << 30, page_bytes=p_target.bytes_per_page, num_pages=8)
    start = time.monotonic()
    result = sender.transfer(DEAD_PEER[backend_name], [0, 1], [2, 3], [layout])
    elapsed = time.monotonic() - start
    print(f"\n[{backend_name}] dead peer failed after {1000 * elapsed:.1f} ms (deadline {deadline_s:g} s)")
    assert result.status is TransferStatus.FAILED and result.num_bytes == 0
    assert DEAD_PEER[backend_name] in result.error
    assert "unreachable" in result.error or "refused" in result.error, result.error  # not "deadline"
    assert elapsed < deadline_s / 2, elapsed
    assert sender.quiescent(DEAD_PEER[backend_name])  # nothing was written


def test_backend_recovers_after_a_failure(make_backend, backend_name):
    p_target, _ = _pools(8, torch.float32, seed=3)
    d_target, _ = _pools(8, torch.float32)
    sender, receiver = make_backend(), make_backend()
    sender.register([p_target.storage])
    layouts = receiver.register([d_target.storage])
    assert not sender.transfer(DEAD_PEER[backend_name], [0], [0], layouts).ok
    assert sender.transfer(receiver.session_id, [0, 1], [1, 0], layouts).ok
    assert torch.equal(d_target.buffer[[1, 0]], p_target.buffer[[0, 1]])


def test_layout_mismatch_is_refused_before_any_write(make_backend):
    p_target, p_draft = _pools(8, torch.float32)
    sender = make_backend()
    layouts = sender.register([p_target.storage, p_draft.storage])
    with pytest.raises(ValueError, match="larger than the peer's"):
        sender.submit("peer", [0], [0], [layouts[0], PoolLayout(0, 123, 8)])
    with pytest.raises(ValueError, match="the peer 1"):
        sender.submit("peer", [0], [0], layouts[:1])
    with pytest.raises(ValueError, match="out of range"):
        sender.submit("peer", [0], [8], layouts)
    with pytest.raises(ValueError, match="2 destination"):
        sender.submit("peer", [0], [0, 1], layouts)
    with pytest.raises(ValueError, match="repeat"):
        sender.submit("peer", [0, 1], [3, 3], layouts)


def test_mooncake_rejected_write_leaves_peer_unquiescent():
    """A write the peer rejects after submission may race other slices: wait drain_s before an AbortAck.
    The peer is unquiescent from the failure until drain_s after it: checked while that is certain (less
    than drain_s since the transfer began), then quiescent no earlier than drain_s after it began."""
    _require("mooncake")
    drain_s = 2.0
    src, dst = torch.randn(4, 256), torch.zeros(4, 256)
    with create_backend("mooncake", drain_s=drain_s) as sender, create_backend("mooncake") as receiver:
        sender.register([src])
        good = receiver.register([dst])[0]
        wrong = PoolLayout(good.base_address + (1 << 40), good.page_bytes, good.num_pages)
        start = time.monotonic()
        result = sender.transfer(receiver.session_id, [0], [1], [wrong])
        assert not result.ok and "failed" in result.error
        quiescent, checked = sender.quiescent(receiver.session_id), time.monotonic() - start
        if checked >= drain_s:
            pytest.skip(f"the check came {checked:.2f} s after the transfer began: the drain may be over")
        assert not quiescent
        deadline = time.monotonic() + drain_s + 30
        while not sender.quiescent(receiver.session_id):
            assert time.monotonic() < deadline, "the peer never became quiescent"
            time.sleep(0.01)
        settled = time.monotonic() - start
        print(f"\nrejected write: checked at {checked:.3f} s, quiescent at {settled:.3f} s (drain {drain_s:g} s)")
        assert settled >= drain_s
        assert not dst.any()


def test_tcp_frozen_peer_times_out():
    """A peer that accepts the connection but never answers (a stopped process) fails at the deadline."""
    ctx = zmq.Context()
    silent = ctx.socket(zmq.ROUTER)
    port = silent.bind_to_random_port("tcp://127.0.0.1")
    timeout_s = 1.0
    try:
        with create_backend("tcp", timeout_s=timeout_s) as sender:
            pool = torch.randn(4, 64)
            sender.register([pool])
            start = time.monotonic()
            result = sender.transfer(f"tcp://127.0.0.1:{port}", [0], [0], [PoolLayout(0, 256, 4)])
            elapsed = time.monotonic() - start
            print(f"\nfrozen peer failed after {elapsed:.3f} s (deadline {timeout_s:g} s)")
            assert not result.ok and "deadline" in result.error, result.error
            # not before its deadline (it starts after `start`), and not a hang nor the 30 s default: well
            # under that however loaded the box
            assert timeout_s <= elapsed < timeout_s + 10, elapsed
    finally:
        silent.close(linger=0)
        ctx.term()


_RECEIVER = textwrap.dedent("""
    import os, sys, torch
    from specpd.disagg.transfer import create_backend
    pool = torch.zeros(16, 2, 2, 4, 2, 8, dtype=torch.bfloat16)
    backend = create_backend(sys.argv[1])
    layout = backend.register([pool])[0]
    print(backend.session_id, layout.base_address, layout.page_bytes, layout.num_pages, flush=True)
    sys.stdin.readline()
    print(pool.float().sum().item(), pool[5].float().sum().item(), flush=True)
    os._exit(0)  # skip engine teardown
""")


def test_two_processes(backend_name):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([os.getcwd(), *sys.path])}
    child = subprocess.Popen([sys.executable, "-c", _RECEIVER, backend_name], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True, env=env)
    try:
        session, base, page_bytes, num_pages = child.stdout.readline().split()
        pool = torch.randn(16, 2, 2, 4, 2, 8).to(torch.bfloat16)
        with create_backend(backend_name) as sender:
            sender.register([pool])
            result = sender.transfer(session, [0, 1, 2], [5, 9, 15],
                                     [PoolLayout(int(base), int(page_bytes), int(num_pages))])
            assert result.ok, result
        child.stdin.write("check\n")
        child.stdin.flush()
        total, page5 = map(float, child.stdout.readline().split())
        assert total == pytest.approx(pool[:3].float().sum().item(), rel=1e-4, abs=1e-3)
        assert page5 == pytest.approx(pool[0].float().sum().item(), rel=1e-4, abs=1e-3)
    finally:
        child.stdin.close()
        child.wait(timeout=30)


def test_raw_throughput(make_backend, backend_name):
    """Prints MB/s of one 32 MiB page transfer (64 pages of 512 KiB); speed is not asserted."""
    src, dst = torch.randn(64, 128 * 1024), torch.zeros(64, 128 * 1024)
    sender, receiver = make_backend(), make_backend()
    sender.register([src])
    layouts = receiver.register([dst])
    sender.transfer(receiver.session_id, [0], [0], layouts)  # connect / handshake outside the timing
    best = 0.0
    for _ in range(3):
        result = sender.transfer(receiver.session_id, range(64), range(64), layouts)
        assert result.ok, result
        best = max(best, result.num_bytes / result.elapsed_s / 1e6)
    assert torch.equal(src, dst)
    print(f"\n[{backend_name}] raw page transfer: {best:.0f} MB/s (64 x 512 KiB, loopback, best of 3)")


def test_a_room_fails_only_once_every_ranks_part_ended(make_backend):
    """kv_sender.RoomTransfer: one part refused (or failed) and another still writing is PENDING, then FAILED
    with the refusal once the write landed: P answers D only when no write of any rank is in flight."""
    from specpd.disagg.kv_sender import Refused, RoomTransfer
    from specpd.disagg.transfer import TransferResult, TransferStatus
    p_target, _ = _pools(8, torch.float32, seed=3)
    d_target, _ = _pools(8, torch.float32)
    sender, receiver = make_backend(), make_backend()
    sender.register([p_target.storage])
    layouts = receiver.register([d_target.storage])
    gate = threading.Event()
    write = sender._write

    def held_write(*args):
        gate.wait(10)
        write(*args)

    sender._write = held_write
    refused = Refused(TransferResult(TransferStatus.FAILED, 2, 0, 0, 0.0, "KV transfer refused: test"))
    room = RoomTransfer([sender.submit(receiver.session_id, [0, 1], [2, 3], layouts), refused], 2)
    assert room.poll() is TransferStatus.PENDING and room.wait(0.05) is None
    gate.set()
    result = room.wait(10)
    assert room.poll() is TransferStatus.FAILED and not result.ok and result.error == "KV transfer refused: test"
    assert torch.equal(d_target.buffer[[2, 3]], p_target.buffer[[0, 1]])  # the other part's write landed first
    ok = RoomTransfer([sender.submit(receiver.session_id, [4], [5], layouts)], 1).wait(10)
    assert ok.ok and ok.num_descriptors == 1 and ok.num_bytes == p_target.bytes_per_page
