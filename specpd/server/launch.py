"""Start `specpd serve` subprocesses on free ports and wait until they answer /health (tests, benchmarks).

`specpd serve --disagg` (cluster.py) supervises its own children: they print to the terminal and keep
their ports; this helper is for callers that want throwaway servers with their logs captured.
"""
from __future__ import annotations

import contextlib
import os
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


def free_port() -> int:
    with socket.socket() as s:
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
