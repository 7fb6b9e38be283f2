"""Start a real `specpd serve` subprocess for tests and stop it afterwards."""
import contextlib

import httpx
import pytest

from specpd.server.launch import ServerStartError, serve_processes

STARTUP_TIMEOUT_S = 300  # first use may download the model; CPUs may be shared


@contextlib.contextmanager
def launch_servers(specs: list[list[str]], timeout_s: float = STARTUP_TIMEOUT_S):
    """Start every `specpd serve ARGS` at once (each on a free --port); yields [(proc, base URL, log path)]
    once all answer /health; stops them all afterwards. A server that fails to start fails the test."""
    try:
        with serve_processes(specs, timeout_s) as procs:
            yield procs
    except ServerStartError as e:
        pytest.fail(str(e))


@contextlib.contextmanager
def launch_server(extra_args: list[str]):
    """Yields {"proc", "client", "base", "model", "total_pages", "log"} once /health answers."""
    with launch_servers([extra_args]) as [(proc, base, log)]:
        with httpx.Client(base_url=base, timeout=120) as client:
            info = client.get("/server_info").json()
            yield {"proc": proc, "client": client, "base": base, "model": info.get("model"),
                   "total_pages": info.get("total_pages"), "log": log}

