"""`specpd serve --disagg NpMd`: a whole PD cluster on this machine from one command. No torch here.

  specpd serve --disagg 1p1d --model default --speculative-algorithm eagle3 --draft-model default \
      --draft-mode both --port 8000

1. Children: N prefill servers (`--role prefill`, HTTP on --prefill-port (default --port+1) and up, bootstrap
   on --bootstrap-port and up), M decode servers (HTTP on --decode-port (default --port+1+N) and up), each a
   `python -m specpd serve` process with every engine flag of this command line.
2. Once every P and D answers /health, the router (`--role router`) starts on --port in front of them.
3. When the router is healthy the URL is printed. Ctrl-C / SIGTERM stops all children; if any child exits,
   the others are stopped and the command fails with that child's exit code.
"""
from __future__ import annotations

import argparse
import re
import signal
import subprocess
import sys
import time

from specpd.server.launch import healthy

STARTUP_TIMEOUT_S = 900.0  # the first start downloads nothing but may load and quantize a model
# flags this launcher sets itself per child; everything else is passed to every P and D
_OWN_FLAGS = {"--disagg": 1, "--port": 1, "--role": 1, "--prefill-port": 1, "--decode-port": 1,
              "--bootstrap-port": 1, "--prefill": 1, "--decode": 1, "--host": 1, "--log-level": 1}


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


def child_commands(args: argparse.Namespace, argv: list[str]) -> tuple[list[list[str]], list[list[str]], list[str]]:
    """(prefill commands, decode commands, router command)."""
    n_p, n_d = parse_layout(args.disagg)
    rest = passthrough(argv)
    base = [sys.executable, "-m", "specpd", "serve", "--host", args.host, "--log-level", args.log_level]
    p_port = args.prefill_port or args.port + 1
    d_port = args.decode_port or args.port + 1 + n_p
    prefill = [base + ["--role", "prefill", "--port", str(p_port + i), "--bootstrap-port",
                       str(args.bootstrap_port + i)] + rest for i in range(n_p)]
    decode = [base + ["--role", "decode", "--port", str(d_port + j)] + rest for j in range(n_d)]
    p_urls = ",".join(f"http://{args.host}:{p_port + i}" for i in range(n_p))
    d_urls = ",".join(f"http://{args.host}:{d_port + j}" for j in range(n_d))
    router = base + ["--role", "router", "--port", str(args.port), "--prefill", p_urls, "--decode", d_urls,
                     "--bootstrap-port", str(args.bootstrap_port)]
    return prefill, decode, router


def _url(cmd: list[str]) -> str:
    return f"http://{cmd[cmd.index('--host') + 1]}:{cmd[cmd.index('--port') + 1]}"


class _Stop(Exception):
    pass


def run_cluster(args: argparse.Namespace, argv: list[str]) -> int:
    try:
        prefill, decode, router = child_commands(args, argv)
    except ValueError as e:
        print(f"specpd serve: {e}", file=sys.stderr)
        return 2
    procs: list[subprocess.Popen] = []

    def stop(*_):
        raise _Stop

    old = {s: signal.signal(s, stop) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        procs += [subprocess.Popen(cmd) for cmd in prefill + decode]
        _wait_healthy(procs, [_url(c) for c in prefill + decode])
        procs.append(subprocess.Popen(router))
        _wait_healthy(procs[-1:], [_url(router)], others=procs[:-1])
        from specpd.server.cli import ready_message
        model = args.argv[args.argv.index("--model") + 1] if "--model" in args.argv else "default"
        print(f"specpd PD cluster ({args.disagg}): prefill {[_url(c) for c in prefill]} "
              f"decode {[_url(c) for c in decode]}", flush=True)
        print(ready_message(args.host, args.port, model), flush=True)
        while True:
            for proc in procs:
                if proc.poll() is not None:
                    print(f"specpd serve --disagg: {' '.join(proc.args[3:7])} exited with {proc.returncode}; "
                          f"stopping the cluster", file=sys.stderr)
                    return proc.returncode or 1
            time.sleep(0.5)
    except _Stop:
        return 0
    except RuntimeError as e:
        print(f"specpd serve --disagg: {e}", file=sys.stderr)
        return 1
    finally:
        for s, handler in old.items():
            signal.signal(s, handler)
        _terminate(procs)


def _wait_healthy(procs: list[subprocess.Popen], urls: list[str], others: list[subprocess.Popen] = ()) -> None:
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    pending = dict(zip(urls, procs))
    while pending:
        for proc in list(pending.values()) + list(others):
            if proc.poll() is not None:
                raise RuntimeError(f"{' '.join(proc.args[3:7])} exited with {proc.returncode} during startup")
        for url in [u for u in pending if healthy(u)]:
            del pending[url]
        if time.monotonic() > deadline:
            raise RuntimeError(f"not healthy after {STARTUP_TIMEOUT_S:g} s: {sorted(pending)}")
        if pending:
            time.sleep(0.3)


def _terminate(procs: list[subprocess.Popen]) -> None:
    for proc in procs:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + 15
    for proc in procs:
        try:
            proc.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
