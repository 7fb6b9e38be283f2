"""specpd.machine: the cores a cluster's children share, and the defaults the machine implies."""
import pytest

from specpd.machine import (HUGE_PAGE, MADV_COLLAPSE, _interior, _madvise, advise_huge_pages, collapse_huge_pages,
                            default_dtype, default_threads, first_touch_on_huge_pages, isa, split_cores, usable_cores)


@pytest.fixture(autouse=True)
def huge_pages(monkeypatch):
    """The suite asks for no huge pages (tests/conftest.py); these tests are about them."""
    monkeypatch.setenv("SPECPD_HUGE_PAGES", "1")


def test_huge_pages_can_be_turned_off(monkeypatch):
    import torch
    t = torch.empty(5 * HUGE_PAGE, dtype=torch.uint8)
    monkeypatch.setenv("SPECPD_HUGE_PAGES", "0")
    assert advise_huge_pages(t.data_ptr(), t.numel()) == 0
    assert collapse_huge_pages([(t.data_ptr(), t.data_ptr() + t.numel())]) == 0
    seen = []
    assert first_touch_on_huge_pages(t.data_ptr(), t.numel(), lambda pos, n: seen.append((pos, n))) == 0
    assert seen == [(0, t.numel())]  # written once, whole


@pytest.mark.parametrize("cores,p,d,want", [
    (2, 1, 1, ([1], [1])),  # this project's box: one thread each
    (1, 1, 1, ([1], [1])),  # fewer cores than servers: never zero threads
    (3, 1, 1, ([1], [2])),  # the remainder goes to decode first
    (8, 1, 2, ([2], [3, 3])),
    (7, 2, 2, ([2, 1], [2, 2])),
    (16, 1, 1, ([8], [8])),
])
def test_split_cores(cores, p, d, want):
    prefill, decode = split_cores(cores, p, d)
    assert (prefill, decode) == want
    assert sum(prefill) + sum(decode) == max(cores, p + d)


def test_machine_defaults_are_consistent(monkeypatch):
    assert usable_cores() >= 1
    assert isa() in ("amx", "avx512_bf16", "avx512", "avx2", "other")
    monkeypatch.delenv("SPECPD_AUTO_DTYPE", raising=False)  # (the suite pins it: tests/conftest.py)
    assert default_dtype("cpu") == ("bfloat16" if isa() in ("amx", "avx512_bf16") else "float32")
    monkeypatch.setenv("SPECPD_AUTO_DTYPE", "float16")
    assert default_dtype("cpu") == "float16"


@pytest.mark.parametrize("env,want", [("1", 1), ("3", 3), (None, None), ("", None), ("0", None), ("two", None)])
def test_default_threads_follow_omp_num_threads_where_it_is_a_positive_number(monkeypatch, env, want):
    if env is None:
        monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    else:
        monkeypatch.setenv("OMP_NUM_THREADS", env)
    assert default_threads() == (want or usable_cores())


def _thp_mode() -> str | None:
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            return f.read().split("[")[1].split("]")[0]
    except (OSError, IndexError):
        return None


def test_huge_pages_are_asked_for_over_the_aligned_interior_only():
    assert advise_huge_pages(HUGE_PAGE + 1, HUGE_PAGE) == 0  # no whole 2 MiB page inside: nothing to ask
    if _thp_mode() in (None, "never"):
        pytest.skip("transparent huge pages are off here")
    import torch
    t = torch.empty(5 * HUGE_PAGE, dtype=torch.uint8)
    got = advise_huge_pages(t.data_ptr(), t.numel())
    assert got % HUGE_PAGE == 0 and 4 * HUGE_PAGE <= got <= 5 * HUGE_PAGE
    t.fill_(7)  # the memory stays ordinary memory
    assert int(t.sum()) == 7 * t.numel()


def test_the_kv_pool_starts_zeroed_and_asks_for_huge_pages():
    import torch
    from specpd.kv.pool import KVPool
    pool = KVPool(64, 30, 16, 3, 64, torch.bfloat16)
    assert pool.storage.count_nonzero() == 0
    if _thp_mode() in ("madvise", "always"):
        # asked for: whether the kernel gives them at once is its own (a busy Firecracker guest gave none to
        # this 22 MiB in one CI run, nor to memory an allocator hands out already faulted in)
        aligned = _interior(pool.storage.data_ptr(), 2 * HUGE_PAGE)[0]  # madvise split the mapping there
        assert "hg" in _vm_flags_at(aligned), "the pool's memory was not advised for huge pages"


@pytest.mark.parametrize("slow_from", [None, 1])
def test_first_touch_takes_huge_pages_only_while_they_come_cheap(monkeypatch, slow_from):
    """Chunks of 4 MiB on a clock that only the touches move; the touch of chunk `slow_from` takes as long as a
    compacting kernel's would: the rest of the memory is written on 4 KB pages (MADV_NOHUGEPAGE), every byte
    written either way."""
    import torch
    import specpd.machine as machine
    monkeypatch.setattr(machine, "HUGE_PAGE_CHUNK", 2 * HUGE_PAGE)
    clock = [0.0]
    monkeypatch.setattr(machine.time, "perf_counter", lambda: clock[0])
    import mmap
    # never touched (an allocator may hand out memory already faulted in)
    region = mmap.mmap(-1, 9 * HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    t = torch.frombuffer(region, dtype=torch.uint8)
    chunks = []

    tail = _interior(t.data_ptr() + 5 * HUGE_PAGE, 2 * HUGE_PAGE)[0]
    flags_then = []

    def touch(at, n):
        slow = slow_from is not None and len(chunks) == slow_from
        clock[0] += (1.5 if slow else 0.5) * n / machine.HUGE_PAGE_MIN_RATE
        chunks.append((at, n))
        flags_then.append(_vm_flags_at(tail))
        t[at:at + n].fill_(3)

    got = first_touch_on_huge_pages(t.data_ptr(), t.numel(), touch)
    machine._later.clear()  # (left for collapse_later_in_background: not this test's)
    assert int(t.sum()) == 3 * t.numel()  # every byte once
    assert sorted(chunks) == chunks and sum(n for _, n in chunks) == t.numel()
    if _thp_mode() in (None, "never"):
        assert got == 0 and chunks == [(0, t.numel())]
        return
    if slow_from is None:
        assert got == t.numel() and len(chunks) == 5
    else:  # two chunks on huge pages, then the rest in one, written on 4 KB pages ("nh"), advised again after
        assert got == 4 * HUGE_PAGE and chunks[-1] == (4 * HUGE_PAGE, 5 * HUGE_PAGE)
        assert "nh" in flags_then[-1] and "hg" not in flags_then[-1], flags_then
        assert "hg" in _vm_flags_at(tail)
    assert all("hg" in f for f in flags_then[:2]), flags_then


def _smaps_line(address: int, field: str) -> list[str]:
    """The words after `field` in /proc/self/smaps for the mapping holding `address` ([] where there is none)."""
    inside = False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                lo, hi = (int(x, 16) for x in head.split("-"))
                inside = lo <= address < hi
            elif inside and line.startswith(field + ":"):
                return line.split()[1:]
    return []


def _vm_flags_at(address: int) -> list[str]:
    """VmFlags of the mapping holding `address`: "hg" MADV_HUGEPAGE, "nh" MADV_NOHUGEPAGE."""
    return _smaps_line(address, "VmFlags")


def _huge_kb_at(address: int) -> int:
    """AnonHugePages (kB) of the mapping holding `address`."""
    return int((_smaps_line(address, "AnonHugePages") or [0])[0])


def test_written_weights_are_collapsed_onto_huge_pages_unchanged(monkeypatch):
    import torch
    from torch import nn
    import specpd.machine as machine
    from specpd.kernels.cpu_linear import weights_on_huge_pages
    # what is collapsed, not when collapsing stops: under a loaded CI box a chunk read slower than the rate and the
    # collapse stopped after 2 MiB (that rule has its own test below)
    monkeypatch.setattr(machine, "HUGE_PAGE_MIN_RATE", 0)
    model = nn.Sequential(nn.Linear(1024, 1024), nn.Linear(1024, 2048))  # 12 MiB of fp32, written by init
    before = [p.clone() for p in model.parameters()]
    import os
    release = tuple(int(x) for x in os.uname().release.split("-")[0].split(".")[:2])
    if release < (6, 1) or _thp_mode() in (None, "never"):
        pytest.skip("no MADV_COLLAPSE here (Linux < 6.1, or THP off)")
    got = weights_on_huge_pages(model)
    if got < 2 * HUGE_PAGE:  # the kernel may have no free huge page to give now (a busy box): that, and nothing else
        import ctypes
        import errno
        aligned = _interior(model[1].weight.data_ptr(), HUGE_PAGE * 2)[0]
        if _madvise(aligned, HUGE_PAGE, MADV_COLLAPSE) != 0 and ctypes.get_errno() in (errno.EAGAIN, errno.ENOMEM):
            pytest.skip("no free huge page to collapse into now")
    assert got % HUGE_PAGE == 0 and got >= 2 * HUGE_PAGE
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    assert _huge_kb_at(_interior(model[1].weight.data_ptr(), 2 * HUGE_PAGE)[0]) * 1024 >= HUGE_PAGE
    assert collapse_huge_pages([(HUGE_PAGE + 1, 2 * HUGE_PAGE)]) == 0  # no whole huge page inside


def test_collapsing_stops_at_the_first_chunk_slower_than_the_rate(monkeypatch):
    """Every chunk reads as slow (a rate no kernel meets): one chunk is collapsed, the rest left as it is."""
    import os
    import torch
    import specpd.machine as machine
    release = tuple(int(x) for x in os.uname().release.split("-")[0].split(".")[:2])
    if release < (6, 1) or _thp_mode() in (None, "never"):
        pytest.skip("no MADV_COLLAPSE here (Linux < 6.1, or THP off)")
    monkeypatch.setattr(machine, "HUGE_PAGE_CHUNK", HUGE_PAGE)
    monkeypatch.setattr(machine, "HUGE_PAGE_MIN_RATE", 1 << 60)
    t = torch.ones(6 * HUGE_PAGE, dtype=torch.uint8)
    got = collapse_huge_pages([(t.data_ptr(), t.data_ptr() + t.numel())])
    if got == 0:
        pytest.skip("no free huge page to collapse into now")
    assert got == HUGE_PAGE and int(t.sum()) == t.numel()


def test_what_start_up_left_on_small_pages_is_collapsed_later_in_the_background(monkeypatch):
    """A first touch that gave up on huge pages after its first (slow) chunk leaves the rest for later; the
    background thread waits while the engine is busy, then collapses it, contents unchanged, and leaves nothing
    for a second call."""
    import mmap
    import time
    import os
    import torch
    import specpd.machine as machine
    release = tuple(int(x) for x in os.uname().release.split("-")[0].split(".")[:2])
    if release < (6, 1) or _thp_mode() in (None, "never"):
        pytest.skip("no MADV_COLLAPSE here (Linux < 6.1, or THP off)")
    monkeypatch.setattr(machine, "HUGE_PAGE_CHUNK", 2 * HUGE_PAGE)
    monkeypatch.setenv("SPECPD_HUGE_PAGES_LATER", "1")
    machine._later.clear()  # (what other tests' first touches left: memory long freed)
    clock, real_clock = [0.0], machine.time.perf_counter
    monkeypatch.setattr(machine.time, "perf_counter", lambda: clock[0])
    region = mmap.mmap(-1, 9 * HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    t = torch.frombuffer(region, dtype=torch.uint8)

    def touch(at, n):  # every chunk slow: the first on huge pages, the rest on 4 KB pages
        clock[0] += 2.0 * n / machine.HUGE_PAGE_MIN_RATE
        t[at:at + n].copy_(torch.arange(at, at + n, dtype=torch.int64).remainder(251).to(torch.uint8))

    assert first_touch_on_huge_pages(t.data_ptr(), t.numel(), touch) == 2 * HUGE_PAGE
    tail = _interior(t.data_ptr() + 5 * HUGE_PAGE, 2 * HUGE_PAGE)[0]
    before = _huge_kb_at(tail)  # (the mapping, one again once the rest is advised: the first chunk's at most)
    assert before <= 2 * HUGE_PAGE // 1024
    monkeypatch.setattr(machine.time, "perf_counter", real_clock)  # the real clock for the thread's pacing
    busy = [True]
    thread = machine.collapse_later_in_background(busy=lambda: busy[0])
    assert thread is not None
    time.sleep(1.0)
    assert _huge_kb_at(tail) == before, "collapsed while the engine was busy"
    state = machine.huge_pages_status()["collapse_after_start_up"]
    assert state["state"] == "running" and state["collapsed_mib"] == 0 and state["left_mib"] >= 10, state
    busy[0] = False
    thread.join(60)
    assert machine.collapse_later_in_background() is None  # nothing left
    state = machine.huge_pages_status()["collapse_after_start_up"]
    assert state["state"] == "done" and state["collapsed_mib"] <= state["left_mib"], state
    after = _huge_kb_at(tail)
    if after == before:  # the kernel may have no free huge page to give right now: that, and nothing else
        import ctypes
        import errno
        if _madvise(tail, HUGE_PAGE, MADV_COLLAPSE) != 0 and ctypes.get_errno() in (errno.EAGAIN, errno.ENOMEM):
            pytest.skip("no free huge page to collapse into now")
    assert after >= before + 5 * HUGE_PAGE // 1024, (before, after)  # the rest: 6 or 7 whole huge pages
    assert state["collapsed_mib"] >= 5 * HUGE_PAGE >> 20, state
    assert torch.equal(t, torch.arange(t.numel(), dtype=torch.int64).remainder(251).to(torch.uint8))


def test_the_collapse_waits_for_every_engine_of_the_process(monkeypatch):
    """Each engine registers its busy check, with memory left to collapse or not: the collapse waits while any of
    them has work (two engines in one process collapsed while the other decoded), and an engine let go of is
    not kept alive by its check."""
    import gc
    import specpd.machine as machine
    monkeypatch.setattr(machine, "_busy_checks", [])
    monkeypatch.setattr(machine, "_later", [])

    class Engine:
        def __init__(self):
            self.work = False

        def has_unfinished_requests(self):
            return self.work

    a, b = Engine(), Engine()
    assert machine.collapse_later_in_background(busy=a.has_unfinished_requests) is None  # nothing left: registered
    assert machine.collapse_later_in_background(busy=b.has_unfinished_requests) is None
    assert not machine._any_busy()
    b.work = True
    assert machine._any_busy()
    del b
    gc.collect()
    assert not machine._any_busy() and len(machine._busy_checks) == 2
    machine.collapse_later_in_background(busy=a.has_unfinished_requests)  # the dead check pruned
    assert len(machine._busy_checks) == 2 and machine._busy_checks[0]() is not None


def test_the_collapse_after_start_up_reports_off_where_it_is_turned_off(monkeypatch):
    """SPECPD_HUGE_PAGES_LATER=0 with memory left on 4 KB pages: no thread, state "off" with what was left; the
    status reads this process's resident and huge-page MiB from Linux."""
    import os
    import specpd.machine as machine
    monkeypatch.setenv("SPECPD_HUGE_PAGES_LATER", "0")
    monkeypatch.setattr(machine, "_collapse", dict(machine._collapse))
    monkeypatch.setattr(machine, "_later", [(0, 6 * HUGE_PAGE)])
    assert machine.collapse_later_in_background() is None and machine._later == []
    status = machine.huge_pages_status()
    assert status["collapse_after_start_up"] == {"state": "off", "left_mib": 12, "collapsed_mib": 0}
    if os.path.exists("/proc/self/smaps_rollup"):
        assert status["resident_mib"] > 0 and 0 <= status["on_huge_pages_mib"] <= status["resident_mib"]
