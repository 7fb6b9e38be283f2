"""Start `specpd serve` subprocesses on free ports and wait until they answer /health (tests, benchmarks).

`specpd serve --disagg` (cluster.py) supervises its own children: they print to the terminal and keep
their ports; this helper is for callers that want throwaway servers with their logs captured.
"""
from __future__ import annotations

import contextlib
import os
import random
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


class ServerStartError(RuntimeError):
    """A server exited or did not become healthy in time; the message ends with its log's tail."""


_PORTS_GIVEN: set[int] = set()  # this process's earlier answers: a server may not have bound its port yet


def _ephemeral_low() -> int:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_port() -> int:
    """A port free on 127.0.0.1 now, for a server started next. Drawn at random from below the kernel's ephemeral
    range: a port from that range (what binding port 0 returns) is also what every outgoing connection and every
    other process's bind to port 0 draws from, so between our check and the server's bind it was sometimes taken
    ("Address already in use" in CI, two test workers starting servers side by side)."""
    low = _ephemeral_low()
    pick = random.SystemRandom()  # not the `random` a test may have seeded alike in every worker
    for _ in range(200):
        port = pick.randrange(max(1024, low - 12000), low)
        if port in _PORTS_GIVEN:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        _PORTS_GIVEN.add(port)
        return port
    with socket.socket() as s:  # that range is full: the kernel's choice
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def healthy(base: str) -> bool:
    try:
        with urllib.request.urlopen(base + "/health", timeout=2) as resp:
            return resp.status == 200
    except OSError:
        return False


def tail(path: str, n: int = 4000) -> str:
    with open(path) as f:
        return f.read()[-n:]


@contextlib.contextmanager
def serve_processes(specs: list[list[str]], timeout_s: float, cpus: list[str | None] | None = None,
                    env: dict[str, str] | None = None, wrappers: list[list[str]] | None = None,
                    hosts: list[str] | None = None):
    """Start every `specpd serve --port FREE ARGS` at once (`cpus[i]`: a taskset CPU list for spec i, where
    taskset exists; `wrappers[i]`: a command it runs under, e.g. `ip netns exec NS`; `hosts[i]`: the address
    its base URL uses, default 127.0.0.1); yields [(proc, base URL, log path)] once all answer /health; stops
    them afterwards. Raises ServerStartError if one exits or is not healthy within `timeout_s`."""
    env = {**os.environ, "PYTHONPATH": REPO + os.pathsep + os.environ.get("PYTHONPATH", ""),
           "OPENBLAS_NUM_THREADS": "1", **(env or {})}
    procs = []
    try:
        for i, args in enumerate(specs):
            port = free_port()
            cmd = [sys.executable, "-m", "specpd", "serve", "--port", str(port), *args]
            cpu = cpus[i] if cpus else None
            if cpu is not None and shutil.which("taskset"):
                cmd = ["taskset", "-c", cpu, *cmd]
            if wrappers:
                cmd = [*wrappers[i], *cmd]
            log = tempfile.NamedTemporaryFile("w+", prefix="specpd-serve-", suffix=".log", delete=False)
            host = hosts[i] if hosts else "127.0.0.1"
            procs.append((subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT),
                          f"http://{host}:{port}", log))
        deadline = time.monotonic() + timeout_s
        for proc, base, log in procs:
            while not healthy(base):
                if proc.poll() is not None:
                    raise ServerStartError(f"{proc.args} exited with {proc.returncode}:\n{tail(log.name)}")
                if time.monotonic() > deadline:
                    raise ServerStartError(f"{proc.args} not healthy after {timeout_s}s:\n{tail(log.name)}")
                time.sleep(0.3)
        yield [(proc, base, log.name) for proc, base, log in procs]
    finally:
        for proc, _, _ in procs:
            proc.terminate()
        for proc, _, log in procs:
            try:
                proc.wait(15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            log.close()
            os.unlink(log.name)
