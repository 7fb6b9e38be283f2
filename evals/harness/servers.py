"""One way to start the servers a benchmark measures, on specpd.server.launch (its port choice below the kernel's
ephemeral range, its wait for /health, its captured logs):

1. `launch`: `specpd serve` processes, each pinned to a CPU list or not, yielding their URLs once all are healthy;
   `unified_cluster`, `pd_cluster` (P on core 0, D on core 1, a router) and `launcher_cluster` (`specpd serve
   --disagg 1p1d`, as `make serve` runs it) are built on it.
2. `start_group` / `wait_healthy` / `stop_group`: any command (`specpd serve --disagg` supervising its children,
   the peers' vLLM and llama.cpp servers) in a process group of its own, waited for, and stopped with its children.
"""
from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time

from specpd.server.launch import REPO, ServerStartError, free_port, healthy, serve_processes, tail

from evals.harness.results import log

__all__ = ["ServerStartError", "free_port", "healthy", "serve_processes", "launch", "unified_cluster",
           "launcher_cluster", "pd_cluster", "keep_logs", "transfer_backend", "start_group", "wait_healthy",
           "stop_group"]


@contextlib.contextmanager
def launch(commands: list[tuple[list[str], str | None]], timeout_s: float = 600):
    """Start `specpd serve` processes ((args, cpu list for taskset) each); yield their URLs once healthy."""
    with serve_processes([["--log-level", "warning", *args] for args, _ in commands], timeout_s,
                         cpus=[cpus for _, cpus in commands], env={"MC_LOG_LEVEL": "ERROR"}) as procs:
        yield [base for _, base, _ in procs]


def unified_cluster(engine_args: list[str], serve_defaults: bool = False):
    if serve_defaults:  # what the user types: the server takes the cores it may use
        return launch([(["--role", "unified", *engine_args], None)])
    return launch([(["--role", "unified", "--num-threads", "2", *engine_args], None)])


@contextlib.contextmanager
def launcher_cluster(engine_args: list[str]):
    """`specpd serve --disagg 1p1d ENGINE_ARGS`, as `make serve` starts it: yields (router, P, D) URLs."""
    p_port, d_port, boot = free_port(), free_port(), free_port()
    with launch([(["--disagg", "1p1d", "--host", "127.0.0.1", "--prefill-port", str(p_port), "--decode-port",
                   str(d_port), "--bootstrap-port", str(boot), *engine_args], None)]) as (router,):
        yield router, f"http://127.0.0.1:{p_port}", f"http://127.0.0.1:{d_port}"


@contextlib.contextmanager
def pd_cluster(engine_args: list[str], backend: str, p_tp: int = 1, d_tp: int = 1):
    """P on core 0, D on core 1 (a TP server's ranks share its core: a correctness run, e.g. descriptors)."""
    boot = free_port()
    common = ["--transfer-backend", backend, "--num-threads", "1", *engine_args]
    with launch([(["--role", "prefill", "--bootstrap-port", str(boot), "--tp-size", str(p_tp), *common], "0"),
                 (["--role", "decode", "--tp-size", str(d_tp), *common], "1")]) as (p, d):
        with launch([(["--role", "router", "--prefill", p, "--decode", d, "--bootstrap-port", str(boot)], None)]) \
                as (router,):
            yield router, p, d


@contextlib.contextmanager
def keep_logs(paths: dict[str, str], tail_chars: int = 3000, header: str = "---- {name} log tail:\n"):
    """On a failure inside the block, each server's log tail on stderr (`header` with its name, then the last
    `tail_chars` characters of the log at paths[name]), then the exception goes on: serve_processes deletes
    the logs once its block exits."""
    try:
        yield
    except BaseException:
        for name, path in paths.items():
            with open(path) as f:
                log(header.format(name=name) + f.read()[-tail_chars:])
        raise


def transfer_backend(choice: str) -> str:
    """`choice`, or tcp (logged) when it is mooncake and the Mooncake engine does not load here."""
    from specpd.disagg.transfer import backend_available
    ok, why = backend_available("mooncake") if choice == "mooncake" else (True, "")
    if not ok:
        log(f"mooncake unavailable ({why}): using tcp")
    return choice if ok else "tcp"


def start_group(cmd: list[str], log_file, env: dict[str, str] | None = None) -> subprocess.Popen:
    """`cmd` in a session (process group) of its own, from the repository root, its output into `log_file`, this
    checkout's specpd first on its PYTHONPATH."""
    env = {**os.environ, "PYTHONPATH": REPO + os.pathsep + os.environ.get("PYTHONPATH", ""), **(env or {})}
    return subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log_file, stderr=subprocess.STDOUT,
                            start_new_session=True)


def wait_healthy(proc: subprocess.Popen, base: str, timeout_s: float, name: str, log_path: str | None = None,
                 poll_s: float = 0.2) -> float:
    """Seconds until `base`/health answers 200. Raises ServerStartError (with the log's tail) if `proc` exits or
    `timeout_s` passes first."""
    t0 = time.perf_counter()
    while not healthy(base):
        why = (f"exited with {proc.returncode}" if proc.poll() is not None else
               f"not healthy after {timeout_s:.0f} s" if time.perf_counter() - t0 > timeout_s else None)
        if why:
            raise ServerStartError(f"{name} {why}" + (f":\n{tail(log_path)}" if log_path else ""))
        time.sleep(poll_s)
    return time.perf_counter() - t0


def stop_group(proc: subprocess.Popen, first: int = signal.SIGTERM, grace_s: float = 20,
               leader_only: bool = False) -> str:
    """Send `first` to the group (`leader_only`: to the leader, which stops its own children), SIGKILL what of
    the group is left after `grace_s`; how it went, in words."""
    exited = proc.poll() is not None
    if not (exited and leader_only):
        with contextlib.suppress(ProcessLookupError):
            proc.send_signal(first) if leader_only else os.killpg(proc.pid, first)
    if exited:
        how = f"already exited ({proc.returncode})"
    else:
        try:
            proc.wait(grace_s)
            how = signal.Signals(first).name
        except subprocess.TimeoutExpired:
            how = f"SIGKILL (no exit {grace_s:.0f} s after {signal.Signals(first).name})"
    try:  # children of a leader that exited on the first signal
        os.killpg(proc.pid, signal.SIGKILL)
        if how == signal.Signals(first).name:
            how += " (process-group leftovers then SIGKILLed)"
    except (ProcessLookupError, PermissionError):
        pass
    proc.wait()
    return how


def group_stats(pgid: int) -> list[list[str]]:
    """/proc/PID/stat of every live process in process group `pgid`, the fields after the command name: state (0),
    ppid (1), pgrp (2), ... utime (11), stime (12)."""
    stats = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == pgid:
            stats.append(fields)
    return stats
