"""PD deadlines measure silence, not work (issue 63): a P and a D in one process over real ZMQ and tcp transfers,
each stepped on its own thread as its server would (test_control_plane.Driver), a tiny random Llama.

- Rooms queued behind a slow P (every engine step of P's takes STEP_S) wait for their record longer than D's
  prefill timeout, and none fails: P's engine steps keep finishing.
- Rooms whose KV writes land one at a time, WRITE_EVERY_S apart, wait for their KV longer than D's transfer
  timeout, and none fails: writes keep ending on P.
- A room whose KV has landed while P runs one engine step longer than D's transfer timeout (P polls its writes
  between steps, so its TransferDone waits for that step): P answers from inside the step, which is work, and
  the room completes.
- A room whose writes never end while P answers every heartbeat still fails once nothing moved for the transfer
  timeout (silence is still silence), and the pages come back.
- A room D registered but cannot give pages yet (D's pool held) outlives P's bootstrap timeout while D keeps
  pinging, then completes.
Each case checks its premise (the wait did outlast the timeout) from D's own stage times, outputs against the
unified engine's, and the pages back on both sides.
"""
import time

from specpd.disagg.transfer import TransferStatus
from specpd.disagg.worker import BootstrapInfo
from tests.disagg.handoff_helpers import GREEDY, make_engine, make_workers, model_dir  # noqa: F401
from tests.disagg.test_control_plane import Driver, stall_next_step, wait_for

HEARTBEAT_TIMEOUT_S = 1.0  # D pings every 0.25 s: P's progress is seen at least that often
STEP_S = 0.6
PREFILL_TIMEOUT_S = 1.5
WRITE_EVERY_S = 0.4
TRANSFER_TIMEOUT_S = 1.5
PROMPTS = [[(7 * i + 3 * k) % 200 + 5 for i in range(40)] for k in range(4)]  # 5 chunks of 8 each, no shared prefix


def slow_steps(engine, seconds: float) -> None:
    step = engine.step

    def slow():
        time.sleep(seconds)  # a slow box: the GIL is free, the control threads run
        return step()

    engine.step = slow


class Gated:
    """A write whose end P sees only at `release_at` (monotonic; None: not until `Gate.open`)."""

    def __init__(self, handle, gate, release_at):
        self.handle, self.gate, self.release_at = handle, gate, release_at

    def _released(self) -> bool:
        return self.gate.opened or (self.release_at is not None and time.monotonic() >= self.release_at)

    def poll(self) -> TransferStatus:
        return self.handle.poll() if self._released() else TransferStatus.PENDING

    def wait(self, timeout=None):
        while not self._released():
            time.sleep(0.01)
        return self.handle.wait(timeout)


class Gate:
    """P's writes, each seen ended `every_s` after the one before (None: none until `open()`)."""

    def __init__(self, p, every_s: float | None):
        self.opened, self.every_s, self._last = False, every_s, time.monotonic()
        submit = p.kv.submit

        def gated(dest, src, dst):
            release = None
            if every_s is not None:
                release = self._last = max(time.monotonic(), self._last) + every_s
            return Gated(submit(dest, src, dst), self, release)

        p.kv.submit = gated

    def open(self) -> None:
        self.opened = True


def run_rooms(drivers, prompts, first_room: int, timeout_s: float = 120) -> list:
    p, d = (drv.worker for drv in drivers)
    for i, prompt in enumerate(prompts):
        info = BootstrapInfo("127.0.0.1", p.bootstrap.port, first_room + i)
        p.expect(f"p{i}", info)
        d.bootstrap(f"d{i}", info)
        drivers[0].call(lambda i=i, prompt=prompt: p.add_request(f"p{i}", prompt, GREEDY))
        drivers[1].call(lambda i=i, prompt=prompt: d.add_request(f"d{i}", prompt, GREEDY))
    wait_for(lambda: all(drivers[1].finished(f"d{i}") for i in range(len(prompts))), timeout_s,
             "D never finished every room")
    return [drivers[1].finished(f"d{i}") for i in range(len(prompts))]


def longest_ms(d, stage: str, n: int) -> float:
    """D's longest `stage` (timeline.py) over rooms d0..d{n-1}, their first token taken as handed out now (what
    D's HTTP stream does as y0 leaves)."""
    for i in range(n):
        d.on_first_token(f"d{i}", time.monotonic())
    return d.stages.summary()[stage]["max_ms"]


def test_rooms_queued_behind_a_slow_prefill_outlive_the_prefill_timeout(model_dir):
    p, d = make_workers(model_dir, heartbeat_timeout_s=HEARTBEAT_TIMEOUT_S, prefill_timeout_s=PREFILL_TIMEOUT_S)
    expected = [o.token_ids for o in make_engine(model_dir).generate(PROMPTS, GREEDY)]
    slow_steps(p.engine, STEP_S)
    drivers = [Driver(p), Driver(d)]
    try:
        outs = run_rooms(drivers, PROMPTS, 100)
        wait_for(lambda: p.free_pages == d.free_pages == 64, 30, "pages not back")
    finally:
        for drv in drivers:
            drv.stop()
        p.close()
        d.close()
    assert [o.error for o in outs] == [None] * len(PROMPTS)
    assert [o.token_ids for o in outs] == expected
    waited = longest_ms(d, "d_wait_record", len(PROMPTS)) / 1000
    print(f"\nthe longest wait for a record: {waited:.2f} s (prefill timeout {PREFILL_TIMEOUT_S:g} s)")
    assert waited > PREFILL_TIMEOUT_S, "the premise: a room waited for its record longer than the timeout"


def test_rooms_whose_writes_keep_landing_outlive_the_transfer_timeout(model_dir):
    p, d = make_workers(model_dir, heartbeat_timeout_s=HEARTBEAT_TIMEOUT_S, transfer_timeout_s=TRANSFER_TIMEOUT_S)
    expected = [o.token_ids for o in make_engine(model_dir).generate(PROMPTS, GREEDY)]
    Gate(p, WRITE_EVERY_S)
    drivers = [Driver(p), Driver(d)]
    try:
        outs = run_rooms(drivers, PROMPTS, 200)
        wait_for(lambda: p.free_pages == d.free_pages == 64, 30, "pages not back")
    finally:
        for drv in drivers:
            drv.stop()
        p.close()
        d.close()
    assert [o.error for o in outs] == [None] * len(PROMPTS)
    assert [o.token_ids for o in outs] == expected
    waited = longest_ms(d, "d_wait_kv", len(PROMPTS)) / 1000
    print(f"\nthe longest wait for a room's KV: {waited:.2f} s (transfer timeout {TRANSFER_TIMEOUT_S:g} s)")
    assert waited > TRANSFER_TIMEOUT_S, "the premise: a room waited for its KV longer than the timeout"


def test_a_room_whose_kv_landed_outlives_the_transfer_timeout_during_one_long_step(model_dir):
    """Rooms A (one chunk) and B (five) enter P's engine in one step, D's page offers already there; A is handed
    off after it, its write held
    in flight until P's next step (B's second chunk) has run 3x D's transfer timeout: only then can P see the
    write end and send A's TransferDone."""
    p, d = make_workers(model_dir, heartbeat_timeout_s=HEARTBEAT_TIMEOUT_S, transfer_timeout_s=TRANSFER_TIMEOUT_S)
    prompts = [PROMPTS[0][:5], PROMPTS[1]]
    expected = [o.token_ids for o in make_engine(model_dir).generate(prompts, GREEDY)]
    gate = Gate(p, None)
    stall = stall_next_step(p.engine, 3 * TRANSFER_TIMEOUT_S, when=lambda: bool(p.inflight))
    drivers = [Driver(p), Driver(d)]
    try:
        for i in range(2):
            info = BootstrapInfo("127.0.0.1", p.bootstrap.port, 250 + i)
            p.expect(f"p{i}", info)
            d.bootstrap(f"d{i}", info)
        drivers[1].call(lambda: [d.add_request(f"d{i}", prompts[i], GREEDY) for i in range(2)])
        wait_for(lambda: {250, 251} <= set(p._destinations), 30, "D's page offers never reached P")
        drivers[0].call(lambda: [p.add_request(f"p{i}", prompts[i], GREEDY) for i in range(2)])  # one step
        assert stall.ended.wait(60), "P never ran its long step with room A in flight"
        gate.open()
        wait_for(lambda: drivers[1].finished("d0") and drivers[1].finished("d1"), 60, "D never finished")
        wait_for(lambda: p.free_pages == d.free_pages == 64, 30, "pages not back")
    finally:
        for drv in drivers:
            drv.stop()
        p.close()
        d.close()
    outs = [drivers[1].finished(f"d{i}") for i in range(2)]
    assert [o.error for o in outs] == [None, None]
    assert [o.token_ids for o in outs] == expected
    waited = longest_ms(d, "d_wait_kv", len(prompts)) / 1000
    print(f"\nthe longest wait for a room's KV: {waited:.2f} s, during one {3 * TRANSFER_TIMEOUT_S:g} s step "
          f"(transfer timeout {TRANSFER_TIMEOUT_S:g} s)")
    assert waited > TRANSFER_TIMEOUT_S, "the premise: a room waited for its KV longer than the timeout"


def test_a_transfer_that_makes_no_progress_still_fails(model_dir):
    p, d = make_workers(model_dir, heartbeat_timeout_s=HEARTBEAT_TIMEOUT_S, transfer_timeout_s=TRANSFER_TIMEOUT_S,
                        abort_timeout_s=1.0)
    gate = Gate(p, None)
    drivers = [Driver(p), Driver(d)]
    try:
        [out] = run_rooms(drivers, PROMPTS[:1], 300, timeout_s=60)
        answered = p.control.heartbeats
        gate.open()  # P's write ends at last: P frees its pages (D freed its own after the abort timeout)
        wait_for(lambda: p.free_pages == d.free_pages == 64, 30, "pages not back")
    finally:
        for drv in drivers:
            drv.stop()
        p.close()
        d.close()
    print(f"\n{out.error}; P answered {answered} heartbeats meanwhile")
    assert out.finish_reason == "abort" and "KV transfer of room 300 made no progress for" in out.error, out.error
    assert answered > 0  # P was alive throughout: only the lack of progress failed the room


def test_a_room_its_decode_server_keeps_claiming_outlives_the_bootstrap_timeout(model_dir):
    """D's pool is held, so D registers the room (and pings P) but offers no pages for longer than P's bootstrap
    timeout; P, hearing D throughout, keeps the room (prefilled optimistically, parked); once D's pages free
    up the request completes."""
    p, d = make_workers(model_dir, heartbeat_timeout_s=HEARTBEAT_TIMEOUT_S)
    p.bootstrap_timeout_s = 1.0
    expected = make_engine(model_dir).generate(PROMPTS[:1], GREEDY)[0].token_ids
    drivers = [Driver(p), Driver(d)]
    held = []
    try:
        drivers[1].call(lambda: held.extend(d.engine.scheduler.allocator.alloc(60)))
        wait_for(lambda: len(held) == 60, 10, "D's pool was never held")
        info = BootstrapInfo("127.0.0.1", p.bootstrap.port, 400)
        p.expect("p0", info)
        d.bootstrap("d0", info)
        drivers[0].call(lambda: p.add_request("p0", PROMPTS[0], GREEDY))
        drivers[1].call(lambda: d.add_request("d0", PROMPTS[0], GREEDY))
        wait_for(lambda: p.queue_sizes()["pd_parked"] == 1, 30, "P never parked the room")
        time.sleep(3 * p.bootstrap_timeout_s)
        assert not drivers[0].finished("p0") and not drivers[1].finished("d0")
        drivers[1].call(lambda: d.engine.scheduler.allocator.free(held))
        wait_for(lambda: drivers[1].finished("d0"), 60, "D never finished the room")
        wait_for(lambda: p.free_pages == d.free_pages == 64, 30, "pages not back")
    finally:
        for drv in drivers:
            drv.stop()
        p.close()
        d.close()
    out = drivers[1].finished("d0")
    assert out.error is None and out.token_ids == expected
    assert drivers[0].finished("p0").finish_reason == "handoff"
