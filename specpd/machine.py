"""What this machine offers the engine: usable cores, the CPU's native number formats, and the defaults they
imply (threads, dtype). Plain Python (no torch), so the launcher can split cores between its children.

The defaults are the best measured configuration on the machine a server starts on (docs/architecture.md §6):
  - threads: OMP_NUM_THREADS where it is set (torch and vLLM's CPU build read it too), else every core this
    process may run on (its affinity mask); a `--disagg` cluster splits the cores between its prefill and
    decode servers (`split_cores`) and gives each child its share as --num-threads;
  - dtype: bfloat16 where the CPU computes it natively (AMX or AVX512-BF16: oneDNN's bf16 GEMMs then cost
    what reading the weights costs, at any row count up to 64), float32 elsewhere (AVX2 / AVX-512 without
    BF16 convert bf16 in software: slower than fp32); float16 on a GPU would be a separate choice.
Every explicit flag wins over these.
"""
from __future__ import annotations

import contextlib
import functools
import inspect
import logging
import os
import shutil
import threading
import time
import weakref

logger = logging.getLogger(__name__)


def cache_root() -> str:
    """Where specpd keeps what it downloads, converts or compiles: $SPECPD_CACHE, else ~/.cache/specpd."""
    return os.environ.get("SPECPD_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "specpd")


def default_threads() -> int:
    """Torch threads for a process not told (--num-threads): OMP_NUM_THREADS if it is a positive number (two
    processes sharing a box, e.g. two test workers, each set it to 1: with every core each they oversubscribe
    the box and their OpenMP threads spin against each other), else usable_cores()."""
    value = os.environ.get("OMP_NUM_THREADS", "").strip()
    return int(value) if value.isdigit() and int(value) > 0 else usable_cores()


def usable_cores() -> int:
    """Cores this process may run on (its affinity mask, e.g. under taskset or a container cpuset)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return max(1, os.cpu_count() or 1)


HUGE_PAGE = 2 << 20  # x86-64's transparent huge page
MADV_HUGEPAGE, MADV_NOHUGEPAGE, MADV_COLLAPSE = 14, 15, 25  # <linux/mman.h>; MADV_COLLAPSE since Linux 6.1
# Huge pages are taken at start-up only while they come cheap. Where free memory is fragmented (page cache, other
# processes), each huge page the kernel hands out waits on compaction: a 512 MiB KV pool took 8.4 s to zero on
# huge pages on a 2-vCPU Xeon that had just run the test suite, 0.2 s on 4 KB pages (and 0.16 s on huge pages
# once compacted). Memory is touched (or collapsed) in chunks of HUGE_PAGE_CHUNK; a chunk slower than
# HUGE_PAGE_MIN_RATE bytes/s (4-5x below a plain first touch on a loaded box) ends the huge pages there.
HUGE_PAGE_CHUNK = 32 << 20
HUGE_PAGE_MIN_RATE = 512 << 20
# what start-up left on 4 KB pages, for collapse_later_in_background: [(start, end)]
_later: list[tuple[int, int]] = []
_later_lock = threading.Lock()
# the background collapse's state (huge_pages_status): none (nothing was left), off, running, done
_collapse = {"state": "none", "left_mib": 0, "collapsed_mib": 0}
# what the collapse waits on: each engine's `busy` check in this process (a bound method weakly, so that an engine
# let go of is not kept; any other callable for the process's life)
_busy_checks: list = []
_starting = [0]  # engines of this process being built (their start-up calibration times the machine)
_threads: list[threading.Thread] = []  # the collapse threads started (wait_for_collapse)


def advise_huge_pages(address: int, nbytes: int) -> int:
    """Ask Linux for transparent huge pages under [address, address + nbytes) (madvise MADV_HUGEPAGE over its
    2 MiB-aligned interior; where THP is `madvise`, the default on Debian, nothing gets them otherwise). Call it
    before the memory is first touched. Returns the bytes advised: 0 where the OS cannot (not Linux, THP off).
    The KV pool takes it: attention reads each sequence's K/V in 4 KB blocks at scattered pages, one TLB miss
    each on 4 KB pages, which huge pages avoid (engine_step.json)."""
    if not os.path.exists("/sys/kernel/mm/transparent_hugepage/enabled") or not huge_pages_wanted():
        return 0
    start, length = _interior(address, nbytes)
    return length if _madvise(start, length, MADV_HUGEPAGE) == 0 else 0


def huge_pages_wanted() -> bool:
    """Whether specpd asks for huge pages at all: yes unless SPECPD_HUGE_PAGES=0 (the test suite, whose hundreds of
    short-lived engines would each pay ~0.5-1 s of the kernel's compaction for memory they read a few times)."""
    return os.environ.get("SPECPD_HUGE_PAGES", "1") != "0"


def first_touch_on_huge_pages(address: int, nbytes: int, touch) -> int:
    """Write fresh memory [address, address + nbytes) for the first time on huge pages while they come cheap:
    MADV_HUGEPAGE, then `touch(offset, length)` (the caller's write of those bytes) chunk by chunk; once a chunk
    is slower than HUGE_PAGE_MIN_RATE (the kernel compacting memory for every huge page), the rest is touched on
    4 KB pages (MADV_NOHUGEPAGE), then advised again and left for collapse_later_in_background. Returns the bytes
    touched with huge pages asked for."""
    start, length = _interior(address, nbytes)
    if advise_huge_pages(address, nbytes) == 0:
        touch(0, nbytes)
        return 0
    pos = 0
    while pos < nbytes:
        n = min(HUGE_PAGE_CHUNK, nbytes - pos)
        t0 = time.perf_counter()
        touch(pos, n)
        slow = (time.perf_counter() - t0) * HUGE_PAGE_MIN_RATE > n
        pos += n
        if slow and pos < nbytes:
            rest = (address + pos + HUGE_PAGE - 1) & ~(HUGE_PAGE - 1)
            _madvise(rest, start + length - rest, MADV_NOHUGEPAGE)
            logger.info("huge pages: %d of %d MiB, then 4 KB pages (the kernel was compacting memory)",
                        pos >> 20, nbytes >> 20)
            touch(pos, nbytes - pos)
            if _madvise(rest, start + length - rest, MADV_HUGEPAGE) == 0:  # collapse_later_in_background
                with _later_lock:
                    _later.append((rest, start + length))
            return pos
    return nbytes


def collapse_huge_pages(spans: list[tuple[int, int]]) -> int:
    """Put memory already written (a model's weights) on huge pages now, while they come cheap: MADV_HUGEPAGE,
    then MADV_COLLAPSE (Linux 6.1+) over each span's 2 MiB-aligned interior in chunks, until one is slower than
    HUGE_PAGE_MIN_RATE; spans within 2 MiB of each other merged (a model's tensors sit side by side in the heap:
    one span). Returns the bytes collapsed; 0 where the kernel cannot."""
    merged: list[list[int]] = []
    for start, end in sorted(spans):
        if merged and start - merged[-1][1] < HUGE_PAGE:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    done = 0
    for start, end in merged:
        length = advise_huge_pages(start, end - start)
        first = _interior(start, end - start)[0]
        for pos in range(first, first + length, HUGE_PAGE_CHUNK):
            n = min(HUGE_PAGE_CHUNK, first + length - pos)
            seconds = _collapse_timed(pos, n)
            if seconds is None:
                break
            done += n
            if seconds * HUGE_PAGE_MIN_RATE > n:
                logger.info("huge pages: %d MiB of weights collapsed, then stopped (the kernel was compacting "
                            "memory)", done >> 20)
                with _later_lock:
                    _later.append((pos + n, first + length))
                    for m in merged:
                        s, ln = _interior(m[0], m[1] - m[0])
                        if m[0] >= end and ln:
                            _later.append((s, s + ln))
                return done
    return done


def collapse_later_in_background(busy=None, duty: float = 0.5) -> threading.Thread | None:
    """Collapse onto huge pages, in a daemon thread, what start-up left on 4 KB pages (first_touch_on_huge_pages,
    collapse_huge_pages) once the server is up, while no engine of this process has work (`busy()` is false, and so
    is every other busy check given here before or after: two engines in one process, as the benchmarks that run
    specpd beside itself make them, each collapsed while the other decoded, and a third of the EAGLE engine's
    verify forwards ran slow beside the plain engine's collapse): one chunk at a time, each followed by a pause
    so that the thread compacts at most `duty` of a core; a request arriving waits at most for one chunk's
    collapse, 8 MiB. A KV pool on 4 KB pages slows a wide decode step's attention (engine_step.json), and
    khugepaged alone collapses 16 MiB per 10 s: tens of minutes for the default model's. None when
    there is nothing to do, or SPECPD_HUGE_PAGES_LATER=0 (the test suite: its servers' timings stay their own);
    the kernel keeps the memory's contents through a collapse."""
    if busy is not None:
        ref = weakref.WeakMethod(busy) if inspect.ismethod(busy) else (lambda: busy)
        with _later_lock:
            _busy_checks[:] = [r for r in _busy_checks if r() is not None] + [ref]
    with _later_lock:
        spans, _later[:] = list(_later), []
    if not spans:
        return None
    _collapse.update(left_mib=sum(end - start for start, end in spans) >> 20, collapsed_mib=0)
    if os.environ.get("SPECPD_HUGE_PAGES_LATER", "1") == "0":
        _collapse["state"] = "off"
        return None
    _collapse["state"] = "running"

    chunk = 4 * HUGE_PAGE

    def run():
        done = 0
        for start, end in spans:
            for pos in range(start, end, chunk):
                while _any_busy():
                    time.sleep(0.25)
                n = min(chunk, end - pos)
                seconds = _collapse_timed(pos, n)
                done += n if seconds is not None else 0
                _collapse["collapsed_mib"] = done >> 20
                time.sleep((seconds or 0.0) * (1 - duty) / duty)
        _collapse["state"] = "done"
        logger.info("huge pages: %d MiB collapsed after start-up", done >> 20)

    thread = threading.Thread(target=run, name="specpd-huge-pages", daemon=True)
    thread.start()
    with _later_lock:
        _threads.append(thread)
    return thread


def wait_for_collapse(timeout: float = 180.0) -> None:
    """Wait, at most `timeout` seconds, for every collapse this process started (collapse_later_in_background)
    to finish: it runs once every engine is idle, so a benchmark that times forwards in process calls this first
    (they then run beside no collapse, on the pages a served process reaches once its collapse ran)."""
    deadline = time.monotonic() + timeout
    with _later_lock:
        threads = list(_threads)
    for thread in threads:
        thread.join(max(0.0, deadline - time.monotonic()))


@contextlib.contextmanager
def starting_up():
    """An engine being built: the collapse waits meanwhile (its start-up calibration times this machine)."""
    with _later_lock:
        _starting[0] += 1
    try:
        yield
    finally:
        with _later_lock:
            _starting[0] -= 1


def _any_busy() -> bool:
    """Some engine of this process has work or is being built (collapse_later_in_background)."""
    with _later_lock:
        if _starting[0]:
            return True
        checks = [r() for r in _busy_checks]
    return any(fn is not None and fn() for fn in checks)


def huge_pages_status() -> dict:
    """This process's memory on huge pages now (AnonHugePages, MiB; None where Linux does not say) of its resident
    MiB, and the background collapse (collapse_later_in_background): none (start-up left nothing on 4 KB pages), off
    (SPECPD_HUGE_PAGES_LATER=0), running or done, with the MiB it was left and has collapsed. In /server_info: a
    server on 4 KB pages runs a wide decode step slower, so a side-by-side benchmark waits
    for the collapse and records this beside its numbers (evals/peers_client.py)."""
    sizes = {}
    try:
        with open("/proc/self/smaps_rollup") as f:
            for line in f:
                key, _, rest = line.partition(":")
                if key in ("Rss", "AnonHugePages"):
                    sizes[key] = int(rest.split()[0]) >> 10
    except (OSError, ValueError, IndexError):
        pass
    return {"on_huge_pages_mib": sizes.get("AnonHugePages"), "resident_mib": sizes.get("Rss"),
            "collapse_after_start_up": dict(_collapse)}


def _collapse_timed(address: int, nbytes: int) -> float | None:
    """MADV_COLLAPSE over [address, address + nbytes): the seconds it took, None where the kernel refused."""
    t0 = time.perf_counter()
    return time.perf_counter() - t0 if _madvise(address, nbytes, MADV_COLLAPSE) == 0 else None


def _interior(address: int, nbytes: int) -> tuple[int, int]:
    """(start, length) of the whole huge pages inside [address, address + nbytes); length 0 where there are none."""
    start = (address + HUGE_PAGE - 1) & ~(HUGE_PAGE - 1)
    return start, max(0, ((address + nbytes) & ~(HUGE_PAGE - 1)) - start)


@functools.lru_cache(maxsize=1)
def _libc_madvise():
    import ctypes
    try:
        madvise = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):
        return None
    madvise.argtypes, madvise.restype = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int), ctypes.c_int
    return madvise


def _madvise(start: int, length: int, advice: int) -> int:
    """madvise(start, length, advice): its return value, -1 for an empty range or without libc."""
    madvise = _libc_madvise()
    return madvise(start, length, advice) if length > 0 and madvise is not None else -1


@functools.lru_cache(maxsize=1)
def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags (/proc/cpuinfo), empty where it cannot be read."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def isa() -> str:
    """The widest vector ISA the engine's CPU paths use: 'amx', 'avx512_bf16', 'avx512', 'avx2' or 'other'."""
    flags = cpu_flags()
    if {"amx_bf16", "amx_tile"} <= flags:
        return "amx"
    if "avx512_bf16" in flags:
        return "avx512_bf16"
    if "avx512f" in flags:
        return "avx512"
    if "avx2" in flags and "fma" in flags:
        return "avx2"
    return "other"


def native_bf16() -> bool:
    """bf16 matmuls run in hardware (AMX tiles or AVX512-BF16 dot products)."""
    return isa() in ("amx", "avx512_bf16")


def default_dtype(device: str = "cpu") -> str:
    """What `--dtype auto` (the default) means here. SPECPD_AUTO_DTYPE overrides it (the test suite pins
    float32 that way: its references are fp32 HF outputs)."""
    pinned = os.environ.get("SPECPD_AUTO_DTYPE")
    if pinned:
        return pinned
    if device != "cpu":
        return "bfloat16"
    return "bfloat16" if native_bf16() else "float32"


def default_attention_backend(device: str = "cpu") -> str:
    """What `--attention-backend auto` means: the fused C kernel on a CPU with a C compiler, else torch; on a
    GPU FlashInfer where it is installed, else Triton."""
    if device == "cpu":
        if os.environ.get("SPECPD_C_KERNELS", "1") == "0":
            return "torch"
        cc = shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc")
        return "cpu" if cc else "torch"
    import importlib.util
    return "flashinfer" if importlib.util.find_spec("flashinfer") is not None else "triton"


def split_cores(cores: int, num_prefill: int, num_decode: int) -> tuple[list[int], list[int]]:
    """Torch threads for each prefill and each decode server of a cluster sharing `cores`: an even share each,
    at least one; cores left over go to the decode servers first (decode latency is what a user waits on
    token by token). Each server's transfer and HTTP threads share its cores (docs/disaggregation.md,
    --engine-priority), so no server is given more threads than its share."""
    servers = num_prefill + num_decode
    if cores <= servers:
        return [1] * num_prefill, [1] * num_decode
    share, extra = divmod(cores, servers)
    decode = [share + (1 if j < extra else 0) for j in range(num_decode)]
    left = max(0, extra - num_decode)
    prefill = [share + (1 if i < left else 0) for i in range(num_prefill)]
    return prefill, decode
