"""Raw Mooncake (loopback TCP) with the sender pinned to core 0 and the receiver to core 1, as P and D
are in evals/pd.py: idle cores vs both cores kept busy by a spinning process each (a stand-in
for P's prefill and D's decode, which own those cores while KV moves in bench_pd), the spinners at
normal priority and under SCHED_IDLE (what `--engine-priority low` does to a server's engine thread).
A second table isolates the GIL: sender and receiver unpinned, with and without a Python thread in the
sender process that keeps the GIL busy (as an engine thread does between torch ops), at the default
5 ms switch interval and at the 0.5 ms that prefill and decode servers set.

Same page size (737,280 B: 16 SmolLM2 tokens, 30 layers, fp32), one descriptor per page, one call per
request-sized batch; median and best MB/s over the calls after 5 warm-up calls.

  python -m evals.pd_transfer          # -> evals/results/pd_transfer.json
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time

EVALS_DIR = os.path.dirname(os.path.abspath(__file__))
PAGE_BYTES = 737_280


def endpoint(role: str, pages: int, calls: int, port: int = 0, ptr: int = 0, switch_us: int = 0) -> None:
    """switch_us > 0: a pure-Python thread holds the GIL whenever it can, at that switch interval."""
    os.environ.setdefault("MC_LOG_LEVEL", "ERROR")
    import threading

    import torch

    from specpd.disagg.transfer.mooncake import load_transfer_engine
    buf = torch.zeros(pages * PAGE_BYTES // 4)
    eng = load_transfer_engine()()
    assert eng.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0
    assert eng.register_memory(buf.data_ptr(), buf.numel() * 4) == 0
    if role == "recv":
        print(json.dumps({"port": eng.get_rpc_port(), "ptr": buf.data_ptr()}), flush=True)
        sys.stdin.read()  # until the parent closes our stdin
        return
    if switch_us:
        sys.setswitchinterval(switch_us / 1e6)

        def hold_gil() -> None:
            while True:
                pass
        threading.Thread(target=hold_gil, daemon=True).start()
    times = []
    for _ in range(calls + 5):
        t0 = time.perf_counter()
        rc = eng.batch_transfer_sync_write(f"127.0.0.1:{port}", [buf.data_ptr() + i * PAGE_BYTES for i in range(pages)],
                                           [ptr + i * PAGE_BYTES for i in range(pages)], [PAGE_BYTES] * pages)
        times.append(time.perf_counter() - t0)
        assert rc == 0, rc
    print(json.dumps(sorted(times[5:])), flush=True)


LOADS = {"idle": None, "busy": [], "busy_sched_idle": ["chrt", "-i", "0"]}  # spinner command prefix
GIL_HOLDER = {"unpinned": 0, "gil_holder_5ms": 5000, "gil_holder_0.5ms": 500}  # switch interval, us


def measure(pages: int, calls: int, load: str) -> dict:
    me = [sys.executable, "-m", "evals.pd_transfer"]  # from the repository root, as this was started
    pinned = load in LOADS
    pin = (lambda core: ["taskset", "-c", core]) if pinned else (lambda core: [])  # noqa: E731
    recv = subprocess.Popen([*pin("1"), *me, "recv", str(pages), str(calls)], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    spinners = []
    try:
        info = json.loads(recv.stdout.readline())
        if pinned and LOADS[load] is not None:
            spinners = [subprocess.Popen([*LOADS[load], "taskset", "-c", c, sys.executable, "-c", "while True: pass"])
                        for c in "01"]
        out = subprocess.run([*pin("0"), *me, "send", str(pages), str(calls), str(info["port"]), str(info["ptr"]),
                              str(GIL_HOLDER.get(load, 0))], capture_output=True, text=True, check=True).stdout
        times = json.loads(out.strip().splitlines()[-1])
    finally:
        for p in spinners:
            p.kill()
        recv.stdin.close()
        recv.wait(10)
    nbytes = pages * PAGE_BYTES
    return {"pages": pages, "bytes_per_call": nbytes, "calls": len(times), "load": load,
            "mb_per_s_median": nbytes / times[len(times) // 2] / 1e6, "mb_per_s_best": nbytes / times[0] / 1e6}


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] in ("send", "recv"):
        role, pages, calls = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
        endpoint(role, pages, calls, *(int(a) for a in sys.argv[4:7]))
        return 0
    from evals.harness.results import log, machine_info, versions, write_json
    rows = [measure(pages, 40, load) for pages in (7, 20) for load in LOADS]
    rows += [measure(pages, 40, load) for pages in (7, 20) for load in GIL_HOLDER]
    for r in rows:
        log(f"{r['pages']:3d} pages/call  {r['load']:16}  median {r['mb_per_s_median']:7.0f} MB/s  "
            f"best {r['mb_per_s_best']:7.0f} MB/s")
    write_json(os.path.join(EVALS_DIR, "results", "pd_transfer.json"),
               {"description": __doc__.split("\n\n")[0], "page_bytes": PAGE_BYTES, "results": rows,
                "machine": machine_info(), "versions": versions()})
    return 0


if __name__ == "__main__":
    sys.exit(main())
