"""Start a real `specpd serve` subprocess for tests and stop it afterwards."""
import contextlib
import os
import socket
import subprocess
import sys
import tempfile
import time

import httpx
import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
STARTUP_TIMEOUT_S = 300  # first use may download the model; CPUs may be shared


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def launch_servers(specs: list[list[str]], timeout_s: float = STARTUP_TIMEOUT_S):
    """Start every `specpd serve ARGS` at once (each on a free --port); yields [(proc, base URL, log path)]
    once all answer /health; stops them all afterwards."""
    env = {**os.environ, "PYTHONPATH": REPO + os.pathsep + os.environ.get("PYTHONPATH", ""),
           "OPENBLAS_NUM_THREADS": "1"}
    procs = []
    try:
        for args in specs:
            port = free_port()
            log = tempfile.NamedTemporaryFile("w+", prefix="specpd-serve-", suffix=".log", delete=False)
            cmd = [sys.executable, "-m", "specpd", "serve", "--port", str(port), *args]
            procs.append((subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT),
                          f"http://127.0.0.1:{port}", log))
        deadline = time.monotonic() + timeout_s
        for proc, base, log in procs:
            while True:
                if proc.poll() is not None:
                    pytest.fail(f"{proc.args} exited with {proc.returncode}:\n{tail(log.name)}")
                if time.monotonic() > deadline:
                    pytest.fail(f"{proc.args} not healthy after {timeout_s}s:\n{tail(log.name)}")
                try:
                    if httpx.get(base + "/health", timeout=2).status_code == 200:
                        break
                except httpx.TransportError:
                    pass
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


@contextlib.contextmanager
def launch_server(extra_args: list[str]):
    """Yields {"proc", "client", "base", "model", "total_pages", "log"} once /health answers."""
    with launch_servers([extra_args]) as [(proc, base, log)]:
        with httpx.Client(base_url=base, timeout=120) as client:
            info = client.get("/server_info").json()
            yield {"proc": proc, "client": client, "base": base, "model": info.get("model"),
                   "total_pages": info.get("total_pages"), "log": log}


def tail(path: str, n: int = 4000) -> str:
    with open(path) as f:
        return f.read()[-n:]
