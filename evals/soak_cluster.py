"""The cluster evals/soak.py runs its load through: `specpd serve --disagg 1p1d ...` started as a child process
(evals.harness.servers; stopped with SIGINT, then SIGKILL to its process group), its processes' RSS sampled, its
free pages read back.
"""
from __future__ import annotations

import signal
import sys
import threading
import time

import httpx

from evals.harness.servers import free_port, start_group, stop_group, wait_healthy

BASE_CMD = ["--disagg", "1p1d", "--model", "default", "--speculative-algorithm", "eagle3", "--draft-model", "default"]


def start_cluster(args, log_file):
    port, p_port, d_port, boot = free_port(), free_port(), free_port(), free_port()
    cmd = [sys.executable, "-m", "specpd", "serve", *BASE_CMD, "--host", "127.0.0.1", "--port", str(port),
           "--prefill-port", str(p_port), "--decode-port", str(d_port), "--bootstrap-port", str(boot),
           "--max-request-bytes", str(args.max_request_bytes), "--log-level", "warning", *args.serve_args.split()]
    proc = start_group(cmd, log_file, env={"OPENBLAS_NUM_THREADS": "1", "MC_LOG_LEVEL": "ERROR"})
    urls = {"router": f"http://127.0.0.1:{port}", "prefill": f"http://127.0.0.1:{p_port}",
            "decode": f"http://127.0.0.1:{d_port}"}
    return proc, cmd, urls


def wait_ready(proc, router: str, timeout_s: float) -> None:
    wait_healthy(proc, router, timeout_s, "launcher", poll_s=1.0)


def stop_cluster(proc) -> dict:
    """SIGINT to the launcher (it stops its children), then SIGKILL to what is left of its process group."""
    t0 = time.monotonic()
    how = stop_group(proc, signal.SIGINT, grace_s=30, leader_only=True)
    return {"how": how, "returncode": proc.returncode, "seconds": round(time.monotonic() - t0, 2)}


def roles_of(launcher_pid: int) -> dict[str, int]:
    """{'launcher', 'prefill', 'decode', 'router'} -> pid, from the launcher's children's command lines."""
    import psutil
    out = {"launcher": launcher_pid}
    try:
        for child in psutil.Process(launcher_pid).children(recursive=True):
            try:
                cl = child.cmdline()
            except psutil.Error:
                continue
            if "--role" in cl:
                out[cl[cl.index("--role") + 1]] = child.pid
    except psutil.Error:
        pass
    return out


def vmrss_mb(pid: int) -> float | None:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


class RssSampler:
    def __init__(self, launcher_pid: int, t0: float, every_s: float = 10.0):
        self.launcher_pid, self.t0, self.every_s = launcher_pid, t0, every_s
        self.samples: list[dict] = []  # {"t", role: {"pid", "rss_mb"}}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def sample(self):
        pids = roles_of(self.launcher_pid)
        self.samples.append({"t": round(time.monotonic() - self.t0, 1),
                             **{r: {"pid": p, "rss_mb": vmrss_mb(p)} for r, p in pids.items()}})

    def _run(self):
        while not self._stop.is_set():
            self.sample()
            self._stop.wait(self.every_s)

    def start(self):
        self._thread.start()

    def stop(self):
        self._stop.set()
        self._thread.join(30)
        self.sample()

    def summary(self, warmup_end_t: float) -> dict:
        out = {}
        for role in ("launcher", "prefill", "decode", "router"):
            pts = [(s["t"], s[role]["rss_mb"], s[role]["pid"]) for s in self.samples
                   if role in s and s[role]["rss_mb"] is not None]
            if not pts:
                out[role] = {"samples": 0}
                continue
            after = [p for p in pts if p[0] >= warmup_end_t] or pts[-1:]
            base, last = after[0], pts[-1]
            out[role] = {"samples": len(pts), "pids_seen": sorted({p[2] for p in pts}),
                         "rss_mb_first": round(pts[0][1], 1), "rss_mb_after_warmup": round(base[1], 1),
                         "warmup_sample_t": base[0], "rss_mb_last": round(last[1], 1), "last_sample_t": last[0],
                         "rss_mb_max": round(max(p[1] for p in pts), 1),
                         "growth_after_warmup_mb": round(last[1] - base[1], 1),
                         "growth_after_warmup_pct": round(100 * (last[1] - base[1]) / base[1], 2)}
        return out


def server_info(url: str, timeout: float = 15) -> dict | None:
    try:
        return httpx.get(url + "/server_info", timeout=timeout).json()
    except (httpx.HTTPError, ValueError):
        return None


def pages_after_drain(urls: dict, timeout_s: float = 30) -> dict:
    """free == total on P and D (through the router's /server_info and from each server), polled up to 30 s."""
    t0 = time.monotonic()
    while True:
        got = {}
        r = server_info(urls["router"]) or {}
        for role in ("prefill", "decode"):
            via = (r.get(role) or [{}])[0]
            own = server_info(urls[role]) or {}
            got[role] = {"url": urls[role], "pid": own.get("pid"),
                         "free_pages": own.get("free_pages"), "total_pages": own.get("total_pages"),
                         "via_router": {"free_pages": via.get("free_pages"), "total_pages": via.get("total_pages")}}
            f, t = own.get("free_pages"), own.get("total_pages")
            got[role]["leaked_pages"] = (t - f) if f is not None and t is not None else None
        if all(g["leaked_pages"] == 0 for g in got.values()) or time.monotonic() - t0 > timeout_s:
            for g in got.values():
                g["waited_s"] = round(time.monotonic() - t0, 1)
            return got
        time.sleep(1.0)
