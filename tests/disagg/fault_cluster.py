"""The fault tests' cluster (test_faults.py): P1, P2, D, D2 and routers A, B, C as `specpd serve`
processes on ports fixed for the module, so a victim comes back on its own ports; requests and checks."""
import concurrent.futures
import contextlib
import os
import signal
import subprocess
import sys
import tempfile
import time

import httpx
import pytest

from specpd.server.launch import REPO, free_port, healthy, tail

HEARTBEAT_TIMEOUT_S = 3.0  # D: a P silent this long while it owes rooms is dead
RESTART_WAIT_S = 3.0  # the routers: a request waits this long for a P or D that is down, then 503 + Retry-After
LONG_HEARTBEAT_TIMEOUT_S = 25.0  # D2: longer than a P takes to restart
ABORT_TIMEOUT_S = 600.0  # D: never the reason pages come back here (a gone P frees them at once)
STARTUP_TIMEOUT_S = 120
PAGE_SIZE = 16
# big enough that a long prompt's prefill and KV write take a while (8 KiB of KV per token)
MODEL = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=4, num_attention_heads=4,
             num_key_value_heads=4, max_position_embeddings=4096)
LONG_PROMPT = [(7 * i + 3) % 300 + 10 for i in range(2000)]  # 125 pages, 16 MB of KV
SHORT = {"prompt": list(range(40, 61)), "max_tokens": 8, "temperature": 0, "ignore_eos": True, "logprobs": 0}


def tokens_of(resp: httpx.Response) -> list[int]:
    assert resp.status_code == 200, resp.text
    return [int(t.removeprefix("token_id:")) for t in resp.json()["choices"][0]["logprobs"]["tokens"]]


def info(url: str) -> dict:
    return httpx.get(url + "/server_info", timeout=10).json()


class Cluster:
    """P1, P2, D and routers A, B as `specpd serve` processes on ports fixed for the module."""

    def __init__(self, model_dir: str):
        self.model_dir = model_dir
        self.ports: dict[str, int] = {}
        for name in ("p1", "p2", "d", "d2", "a", "b", "c", "boot1", "boot2"):
            while (port := free_port()) in self.ports.values():
                pass
            self.ports[name] = port
        self.url = {name: f"http://127.0.0.1:{self.ports[name]}" for name in ("p1", "p2", "d", "d2", "a", "b", "c")}
        self.procs: dict[str, subprocess.Popen] = {}
        self.logs: dict[str, str] = {}  # name -> the log of its current process
        self.all_logs: list[str] = []

    def args(self, name: str) -> list[str]:
        engine = ["--model", self.model_dir, "--page-size", str(PAGE_SIZE), "--num-pages", "384",
                  "--num-threads", "1", "--transfer-backend", "tcp"]
        if name in ("p1", "p2"):
            return ["--role", "prefill", "--bootstrap-port", str(self.ports["boot" + name[1]]), *engine]
        if name in ("d", "d2"):
            heartbeat = HEARTBEAT_TIMEOUT_S if name == "d" else LONG_HEARTBEAT_TIMEOUT_S
            # repeated prompts hit D's prefix cache: --pd-local-prefill-tokens 0 keeps every room on P
            return ["--role", "decode", "--pd-heartbeat-timeout", str(heartbeat),
                    "--pd-abort-timeout", str(ABORT_TIMEOUT_S), "--pd-local-prefill-tokens", "0", *engine]
        p, d = {"a": ("p1", "d"), "b": ("p2", "d"), "c": ("p1", "d2")}[name]
        return ["--role", "router", "--prefill", self.url[p], "--decode", self.url[d],
                "--bootstrap-port", str(self.ports["boot" + p[1]]), "--pd-restart-wait", str(RESTART_WAIT_S)]

    def spawn(self, name: str) -> None:
        env = {**os.environ, "PYTHONPATH": REPO + os.pathsep + os.environ.get("PYTHONPATH", ""),
               "OPENBLAS_NUM_THREADS": "1"}
        log = tempfile.NamedTemporaryFile("w+", prefix=f"specpd-faults-{name}-", suffix=".log", delete=False)
        cmd = [sys.executable, "-m", "specpd", "serve", "--port", str(self.ports[name]), "--log-level", "warning",
               *self.args(name)]
        self.procs[name] = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)
        self.logs[name] = log.name
        self.all_logs.append(log.name)
        log.close()

    def wait_healthy(self, names, timeout_s: float = STARTUP_TIMEOUT_S) -> None:
        deadline = time.monotonic() + timeout_s
        for name in names:
            while not healthy(self.url[name]):
                proc = self.procs[name]
                if proc.poll() is not None:
                    pytest.fail(f"{name} exited with {proc.returncode}:\n{tail(self.logs[name])}")
                if time.monotonic() > deadline:
                    pytest.fail(f"{name} not healthy after {timeout_s}s:\n{tail(self.logs[name])}")
                time.sleep(0.2)

    def start(self, names) -> None:
        for name in names:
            self.spawn(name)
        self.wait_healthy(names)

    def pid(self, name: str) -> int:
        return self.procs[name].pid

    def kill(self, name: str) -> float:
        """SIGKILL `name` (thawed first if frozen); returns the monotonic time of the kill."""
        proc = self.procs[name]
        with contextlib.suppress(ProcessLookupError):
            os.kill(proc.pid, signal.SIGKILL)
        killed = time.monotonic()
        proc.wait(10)
        return killed

    def ensure_up(self) -> None:
        """Every server up (a dead one restarted on its ports, a frozen one thawed) and idle."""
        down = []
        for name, proc in self.procs.items():
            with contextlib.suppress(ProcessLookupError):
                os.kill(proc.pid, signal.SIGCONT)
            if proc.poll() is not None:
                down.append(name)
        for name in down:
            self.spawn(name)
        self.wait_healthy(list(self.procs))
        for name in ("p1", "p2", "d", "d2"):  # 45 s: what a test before may have left has its timeouts
            assert_pages_back(self.url[name], 45)

    def close(self) -> None:
        for proc in self.procs.values():
            with contextlib.suppress(ProcessLookupError):
                os.kill(proc.pid, signal.SIGCONT)
            proc.terminate()
        for proc in self.procs.values():  # nothing to keep: a server still draining is killed
            try:
                proc.wait(3)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        for path in self.all_logs:
            with contextlib.suppress(OSError):
                os.unlink(path)


def assert_pages_back(url: str, timeout_s: float) -> dict:
    """Poll /server_info until free_pages == total_pages and no PD queue holds a room."""
    deadline = time.monotonic() + timeout_s
    while True:
        got = info(url)
        queues = {k: v for k, v in got.items()  # counters are not queues
                  if k.startswith("pd_") and isinstance(v, int) and k not in ("pd_heartbeats_answered",
                                                                               "pd_local_prefills")}
        if got["free_pages"] == got["total_pages"] and not any(queues.values()):
            return got
        assert time.monotonic() < deadline, (url, got["free_pages"], got["total_pages"], queues)
        time.sleep(0.1)


def post(url: str, body: dict, timeout: float = 60) -> tuple[httpx.Response | Exception, float]:
    """(the response or the transport error, the monotonic time it came)."""
    try:
        resp = httpx.post(url + "/v1/completions", json=body, timeout=timeout)
    except httpx.TransportError as e:
        return e, time.monotonic()
    return resp, time.monotonic()


def bystanders(pool, url: str, n: int) -> list[concurrent.futures.Future]:
    """n requests at once, in the background, through the router that is not involved."""
    return [pool.submit(post, url, SHORT) for _ in range(n)]


def check_bystanders(futures, want: list[int]) -> None:
    for fut in futures:
        resp, _ = fut.result(timeout=120)
        assert isinstance(resp, httpx.Response), repr(resp)
        assert tokens_of(resp) == want
