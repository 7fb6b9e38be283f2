"""`specpd serve --disagg NpMd`: a whole PD cluster on this machine from one command, supervised. No torch here.

  specpd serve --disagg 1p1d --model default --speculative-algorithm eagle3 --draft-model default \
      --draft-mode both --port 8000

1. Transfer backend: `--transfer-backend` if given, else decided once here (mooncake where its engine loads,
   else tcp, with one line saying why) and passed explicitly to every P and D, so they never disagree.
2. Threads: the cores this command may use are split between the children (specpd.machine.split_cores: an
   even share each, the remainder to decode servers first; 1p1d on 2 cores: one torch thread each), passed as
   --num-threads unless the command line gives --num-threads itself (then every child gets that). With
   --prefill-tp / --decode-tp a child runs that many tensor-parallel ranks (--tp-size) and its share of the
   cores is divided between them (--num-threads is per rank).
   Children: N prefill servers (`--role prefill`, HTTP on --prefill-port (default --port+1) and up, bootstrap
   on --bootstrap-port and up), M decode servers (HTTP on --decode-port (default --port+1+N) and up), each a
   `python -m specpd serve` process with every engine flag of this command line. P and D bind loopback
   whatever --host says (their HTTP, bootstrap, control and transfer sockets: only the router, on this box,
   talks to them); the router binds --host.
   The API key (--api-key-file, $SPECPD_API_KEY or --api-key; admission.py) goes to every child in its
   environment (SPECPD_API_KEY), never on a command line (`ps` shows those to every user): the router and
   P and D all require it, and the router sends it to P and D.
3. Once every P and D answers /health, the router (`--role router`) starts on --port in front of them, with
   --cluster-ready-file: its /health answers 503 ("cluster starting") until that file exists. When the router's
   app answers, the launcher prints the ready line and then creates the file, so nothing sees the router's
   /health 200 before the ready line (a load balancer's probe, a test, a user's script). A child that dies or
   never answers before it was ever healthy fails the command, naming it.
4. Supervision, from the moment a child first answered its health check, whatever the others are doing (the
   router may still be starting): a child that exits, or whose health check fails for HEALTH_GRACE_S in a row
   (P, D: /health 200 within HEALTH_TIMEOUT_S; the router: any answer of its own app, since its /health waits
   on and reports its backends; a loaded server answers late, never that late), or whose /health answers an
   error DEAD_GRACE_S in a row (P, D: the server runs but its engine died, so it cannot generate: no load makes
   it answer that), is stopped and started again
   with the same command line (same ports) after a backoff (1, 2, 4 .. 30 s, reset once it stayed up
   STABLE_S), each step logged. Meanwhile the router serves through the others; a request that needs the
   dead child waits for it a bounded time, then gets 503 with Retry-After (router.py). A restarted D comes
   back with an empty pool (P's rooms toward the old D fail by the transfer rules); a restarted P has new
   control ports, which D re-resolves from the bootstrap port once the old connection dropped. A child that
   cannot come back MAX_FAILED_STARTS times in a row stops the cluster.
5. Ctrl-C / SIGTERM stops all children.
"""
from __future__ import annotations

import argparse
import http.client
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request

from specpd.admission import API_KEY_ENV
from specpd.machine import split_cores, usable_cores
from specpd.server.ready import ready_message

STARTUP_TIMEOUT_S = 900.0  # the first start downloads nothing but may load and quantize a model
HEALTH_INTERVAL_S = 2.0  # between health checks of a child that is up
STARTING_INTERVAL_S = 0.2  # between health checks of a child that is starting
SUPERVISE_INTERVAL_S = 0.5
HEALTH_TIMEOUT_S = 10.0  # a P or D busy with a burst on a shared box answered /health in > 5 s (pd_load)
HEALTH_GRACE_S = 60.0  # failing this long in a row is a hung server, not a busy one
DEAD_GRACE_S = 3.0  # /health answering an error this long in a row: the engine is dead (a busy one answers 200)
BACKOFF_S = (1.0, 2.0, 4.0, 8.0, 16.0, 30.0)
STABLE_S = 60.0  # up this long: the next crash restarts after the shortest backoff again
MAX_FAILED_STARTS = 5  # restarts in a row that never became healthy
# flags this launcher sets itself per child; everything else is passed to every P and D
_OWN_FLAGS = {"--disagg": 1, "--port": 1, "--role": 1, "--prefill-port": 1, "--decode-port": 1,
              "--bootstrap-port": 1, "--prefill": 1, "--decode": 1, "--host": 1, "--log-level": 1,
              "--transfer-backend": 1, "--api-key": 1, "--api-key-file": 1,  # the key: in the environment
              "--cluster-ready-file": 1, "--advertise-host": 1, "--prefill-tp": 1, "--decode-tp": 1,
              "--pd-restart-wait": 1}
LOOPBACK = "127.0.0.1"  # where P and D listen (module docstring, step 2)
_PROBE = ("from specpd.disagg.transfer import backend_available as a; ok, why = a('mooncake'); "
          "print('' if ok else why)")


def parse_layout(spec: str) -> tuple[int, int]:
    m = re.fullmatch(r"(\d+)p(\d+)d", spec.strip().lower())
    if m is None or int(m.group(1)) < 1 or int(m.group(2)) < 1:
        raise ValueError(f"--disagg takes NpMd with N, M >= 1 (e.g. 1p1d), got {spec!r}")
    return int(m.group(1)), int(m.group(2))


def passthrough(argv: list[str]) -> list[str]:
    """The command line minus the flags the launcher sets per child (both `--flag v` and `--flag=v`)."""
    out, i = [], 0
    while i < len(argv):
        name = argv[i].split("=", 1)[0]
        if name in _OWN_FLAGS:
            i += 1 if "=" in argv[i] else 1 + _OWN_FLAGS[name]
            continue
        out.append(argv[i])
        i += 1
    return out


def choose_transfer_backend(requested: str | None) -> str:
    """The user's choice, else mooncake if its engine loads here (probed in a child: no torch in this
    process), else tcp with one line saying why."""
    if requested:
        return requested
    try:
        probe = subprocess.run([sys.executable, "-c", _PROBE], capture_output=True, text=True, timeout=300)
        why = probe.stdout.strip() if probe.returncode == 0 else (probe.stderr.strip().splitlines() or ["?"])[-1]
    except (OSError, subprocess.TimeoutExpired) as e:
        why = f"probe failed: {e}"
    if not why:
        return "mooncake"
    print(f"specpd serve --disagg: transfer backend tcp: mooncake cannot load here ({why})", file=sys.stderr,
          flush=True)
    return "tcp"


def child_commands(args: argparse.Namespace, argv: list[str], transfer_backend: str = "tcp"
                   ) -> tuple[list[list[str]], list[list[str]], list[str]]:
    """(prefill commands, decode commands, router command)."""
    n_p, n_d = parse_layout(args.disagg)
    rest = passthrough(argv)
    base = [sys.executable, "-m", "specpd", "serve", "--host", LOOPBACK, "--log-level", args.log_level]
    pd = ["--transfer-backend", transfer_backend]
    p_port = args.prefill_port or args.port + 1
    d_port = args.decode_port or args.port + 1 + n_p
    p_threads, d_threads = split_cores(usable_cores(), n_p, n_d)
    given = any(a.split("=", 1)[0] == "--num-threads" for a in rest)  # the user's choice goes to every child

    def threads(n: int, tp: int | None) -> list[str]:  # --num-threads is per tensor-parallel rank
        return ([] if given else ["--num-threads", str(max(1, n // (tp or 1)))]) + (
            ["--tp-size", str(tp)] if tp else [])
    p_tp, d_tp = getattr(args, "prefill_tp", None), getattr(args, "decode_tp", None)
    prefill = [base + ["--role", "prefill", "--port", str(p_port + i), "--bootstrap-port",
                       str(args.bootstrap_port + i)] + pd + rest + threads(p_threads[i], p_tp) for i in range(n_p)]
    decode = [base + ["--role", "decode", "--port", str(d_port + j)] + pd + rest + threads(d_threads[j], d_tp)
              for j in range(n_d)]
    p_urls = ",".join(f"http://{LOOPBACK}:{p_port + i}" for i in range(n_p))
    d_urls = ",".join(f"http://{LOOPBACK}:{d_port + j}" for j in range(n_d))
    router = [sys.executable, "-m", "specpd", "serve", "--host", args.host, "--log-level", args.log_level,
              "--role", "router", "--port", str(args.port), "--prefill", p_urls, "--decode", d_urls,
              "--bootstrap-port", str(args.bootstrap_port), "--max-request-bytes", str(args.max_request_bytes),
              "--pd-restart-wait", str(args.pd_restart_wait)]
    return prefill, decode, router


def child_env(api_key: str | None) -> dict[str, str]:
    """Every child's environment: ours, with the cluster's key (or none) in SPECPD_API_KEY."""
    env = {k: v for k, v in os.environ.items() if k != API_KEY_ENV}
    return {**env, API_KEY_ENV: api_key} if api_key else env


def _url(cmd: list[str]) -> str:
    return f"http://{cmd[cmd.index('--host') + 1]}:{cmd[cmd.index('--port') + 1]}"


OK, SILENT, DEAD = "ok", "silent", "dead"  # a health check's outcomes: 200; no answer; an error answer


def _health(base: str) -> str:
    try:
        with urllib.request.urlopen(base + "/health", timeout=HEALTH_TIMEOUT_S) as resp:
            return OK if resp.status == 200 else DEAD
    except urllib.error.HTTPError:  # the server answers that it cannot generate (its engine died)
        return DEAD
    except (OSError, http.client.HTTPException):  # refused, timed out, or cut off mid-answer (a server killed)
        return SILENT


def _answers(base: str) -> bool:
    """The router is up if its own app answers (a 404 for a path it does not route): its /health asks every
    backend and is 503 while one is down."""
    try:
        with urllib.request.urlopen(base + "/specpd-supervisor-ping", timeout=HEALTH_TIMEOUT_S):
            return True
    except urllib.error.HTTPError:
        return True
    except (OSError, http.client.HTTPException):
        return False


def _log(message: str) -> None:
    print(f"specpd serve --disagg: {message}", file=sys.stderr, flush=True)


class _Child:
    """One supervised server: its command line, process, and restart state."""

    def __init__(self, cmd: list[str], env: dict[str, str] | None = None):
        self.cmd, self.env = cmd, env
        self.url = _url(cmd)
        self.role = cmd[cmd.index("--role") + 1]
        self.name = f"{self.role} {self.url}"
        self.proc: subprocess.Popen | None = None
        self.up = False  # answered its health check since the last (re)start
        self.ever_up = False  # answered one since the launcher began: from then on a death is a restart case
        self.started_at = self.up_since = 0.0
        self.failing_since: float | None = None
        self.dead_since: float | None = None  # its /health has answered an error since then
        self.next_check = 0.0
        self.restart_at: float | None = None  # waiting out a backoff
        self.crashes = 0  # restarts since it was last up STABLE_S
        self.failed_starts = 0  # restarts in a row that never became healthy

    def start(self) -> None:
        self.proc = subprocess.Popen(self.cmd, env=self.env)
        self.started_at, self.up, self.failing_since, self.restart_at = time.monotonic(), False, None, None
        self.dead_since = None
        self.next_check = 0.0

    def health(self) -> str:
        if self.role == "router":
            return OK if _answers(self.url) else SILENT
        return _health(self.url)

    def supervise(self, now: float) -> None:
        """One look at the child. Raises RuntimeError when the cluster must stop: a child that died or timed
        out before it was ever healthy (a start-up failure), or one that failed to come back too often."""
        if self.proc is None:
            return  # not started yet (the router, until P and D are up)
        if self.restart_at is not None:
            if now >= self.restart_at:
                _log(f"starting {self.name} again (restart {self.crashes})")
                self.start()
            return
        if self.proc.poll() is not None:
            if not self.ever_up:
                raise RuntimeError(f"{self.name} exited with {self.proc.returncode} during startup, before it "
                                   f"ever answered its health check")
            self._restart(now, f"exited with {self.proc.returncode}")
            return
        if now < self.next_check:
            return
        # starting: look often (the ready line should follow the first answer closely); up: every interval
        self.next_check = now + (HEALTH_INTERVAL_S if self.up else STARTING_INTERVAL_S)
        health = self.health()
        ok = health == OK
        if not self.up:
            if ok:
                self.up, self.up_since, self.failed_starts = True, now, 0
                if self.ever_up:
                    _log(f"{self.name} is back up")
                self.ever_up = True
            elif now - self.started_at > STARTUP_TIMEOUT_S:
                if not self.ever_up:
                    raise RuntimeError(f"{self.name} not healthy {STARTUP_TIMEOUT_S:g} s after its start")
                self._restart(now, f"not healthy {STARTUP_TIMEOUT_S:g} s after its start")
            return
        if ok:
            self.failing_since = self.dead_since = None
            if now - self.up_since > STABLE_S:
                self.crashes = 0
            return
        self.failing_since = self.failing_since or now
        self.dead_since = (self.dead_since or now) if health == DEAD else None
        if self.dead_since is not None and now - self.dead_since > DEAD_GRACE_S:
            self._restart(now, f"health check answering an error for {now - self.dead_since:.0f} s (its engine "
                               f"cannot generate)")
        elif now - self.failing_since > HEALTH_GRACE_S:
            self._restart(now, f"health check failing for {now - self.failing_since:.0f} s")

    def _restart(self, now: float, why: str) -> None:
        if not self.up:
            self.failed_starts += 1
            if self.failed_starts >= MAX_FAILED_STARTS:
                raise RuntimeError(f"{self.name} {why}; it failed to come back {self.failed_starts} times in a row")
        _stop([self.proc], timeout_s=5.0)
        self.up = False
        delay = BACKOFF_S[min(self.crashes, len(BACKOFF_S) - 1)]
        self.crashes += 1
        self.restart_at = now + delay
        _log(f"{self.name} {why}; restarting it in {delay:g} s (the others keep serving)")


class _Stop(Exception):
    pass


def run_cluster(args: argparse.Namespace, argv: list[str]) -> int:
    try:
        parse_layout(args.disagg)
    except ValueError as e:
        print(f"specpd serve: {e}", file=sys.stderr)
        return 2
    transfer_backend = choose_transfer_backend(args.transfer_backend)
    prefill, decode, router_cmd = child_commands(args, argv, transfer_backend)
    ready_dir = tempfile.mkdtemp(prefix="specpd-cluster-")
    ready_file = os.path.join(ready_dir, "ready")
    env = child_env(args.api_key)
    servers = [_Child(cmd, env) for cmd in prefill + decode]
    router = _Child(router_cmd + ["--cluster-ready-file", ready_file], env)
    children = servers + [router]

    def stop(*_):
        raise _Stop

    old = {s: signal.signal(s, stop) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        for child in servers:
            child.start()
        ready = False
        while True:
            now = time.monotonic()
            for child in children:
                child.supervise(now)
            if router.proc is None and all(c.up for c in servers):
                router.start()
            if not ready and router.up:
                model = args.argv[args.argv.index("--model") + 1] if "--model" in args.argv else "default"
                print(f"specpd PD cluster ({args.disagg}, transfer backend {transfer_backend}): prefill "
                      f"{[_url(c) for c in prefill]} decode {[_url(c) for c in decode]}", flush=True)
                print(ready_message(args.host, args.port, model), flush=True)
                with open(ready_file, "w") as f:  # now the router's /health may answer 200
                    f.write(f"{os.getpid()}\n")
                ready = True
            time.sleep(SUPERVISE_INTERVAL_S if ready else STARTING_INTERVAL_S)
    except _Stop:
        return 0
    except RuntimeError as e:
        _log(f"{e}; stopping the cluster")
        return 1
    finally:
        for s, handler in old.items():
            signal.signal(s, handler)
        _stop([c.proc for c in children if c.proc is not None])
        shutil.rmtree(ready_dir, ignore_errors=True)


def _stop(procs: list[subprocess.Popen], timeout_s: float = 15.0) -> None:
    """SIGTERM, then SIGKILL whatever has not exited after `timeout_s`."""
    for proc in procs:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + timeout_s
    for proc in procs:
        try:
            proc.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
