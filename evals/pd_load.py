"""PD under load: does `specpd serve --disagg 1p1d` with EAGLE-3 hold a burst, with other work on the box?

The reported failures: issue 11, 32 requests at once (8 of them ~1,500-token prompts, max_tokens 32) with two
`nice`d busy loops on the box, 18 failed with "prefill server ... is not answering: no heartbeat for 10.3 s" (P's
heartbeat waited for its engine step); issue 63, on a 2-core AVX2 EPYC, 48 requests at once (a quarter ~1.5k-token
prompts, 32 tokens out) with one `nice`d neighbour, 3 failed with "KV transfer of room ... did not finish within
60 s" while P was alive and working through its queue (D's deadlines counted P's queue as silence).

Cases, one cluster for all (the launcher, its P, D and router as real processes on 127.0.0.1, `specpd serve
--disagg 1p1d --speculative-algorithm eagle3 --draft-model default`, default timeouts and pool sizes):
  burst N (--sizes, default 48): N requests at once, 25% long (--long-len tokens of ShareGPT text), the rest
  held-out ShareGPT first turns (chat template), greedy, ignore_eos, max_tokens 32, non-streamed
  /v1/completions; with each count of `nice -n 10 python -c 'while True: pass'` loops in --busy (default 1).
Per case: failed requests (any non-200, with the distinct error messages), wall time, P's and D's free pages
back to their totals afterwards, and heartbeat round trips: a probe of this script pings P's control socket
every 50 ms during the burst (`p_heartbeat_ms`: p50 / p99 / max, this case only), and D's own pings to P
(`d_heartbeat_rtt_ms` from D's /server_info: its last 2000, so cumulative over the cases so far). The run names
the CPU's ISA (`specpd.machine.isa()`) and the code path it was forced to, if any (`forced`: the variables of
FORCE_AVX2 found in the environment).

  python -m evals.pd_load                      # -> evals/results/pd_load.json
  python -m evals.pd_load --out /tmp/x.json --sizes 32 --busy 0      # one quick case
  python -m evals.pd_load --merge before=OLD.json --merge avx2_forced=AVX2.json   # other runs under those keys

The AVX2 code path on an AVX-512 box (the closest this box comes to issue 63's AVX2 EPYC): run with FORCE_AVX2
in the environment. The C kernels are then built for x86-64-v3 (AVX2, no AVX-512: the project's GEMM kernels and
the C stack, AVX-512 only, stay off, as on an AVX2 CPU), dtype auto is float32 (no native bf16 on AVX2), and
oneDNN and ATen are capped at AVX2. The cores, their speed and the memory system stay this box's.

evals/results/pd_load.json: issue 63's load on this box (an AMD EPYC, AVX-512 BF16) after the fix ("cases"),
and, merged, the same script run from an export of 7e069e3 (before the fix) on the default path ("before") and
with FORCE_AVX2 ("before_avx2_forced"), and after the fix with FORCE_AVX2 ("avx2_forced"). Only the
before-the-fix AVX2 run failed requests: its D logged the issue's "KV transfer of room ... did not finish within
60 s" (and a prefill deadline) while P was inside one engine step for minutes, then the launcher restarted P
when its /health stopped answering, and the clients saw those requests fail as "prefill server unreachable"
(its `cluster_log_tail`). The merged runs predate the script's `command` field (theirs is the served
command). The box's two cores were shared with other engineers' work throughout; the issue-11 runs are in git
history.
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import subprocess
import sys
import threading
import time

EVALS_DIR = os.path.dirname(os.path.abspath(__file__))
from evals.harness.prompts import held_out_sharegpt_prompts, real_text_prompts
from evals.harness.results import log, machine_info, versions, write_json
from evals.harness.servers import keep_logs

import httpx

from specpd.server.launch import free_port, serve_processes

RESULTS_DIR = os.path.join(EVALS_DIR, "results")
BUSY_LOOP = "while True: pass"
# the AVX2 code path on an AVX-512 CPU (module docstring): every child of the cluster inherits these
FORCE_AVX2 = {"SPECPD_KERNEL_MARCH": "x86-64-v3", "SPECPD_AUTO_DTYPE": "float32", "ONEDNN_MAX_CPU_ISA": "AVX2",
              "ATEN_CPU_CAPABILITY": "avx2"}


@contextlib.contextmanager
def cluster(extra: list[str], timeout_s: float = 900):
    """`specpd serve --disagg 1p1d` on free ports; yields (router, P, D) URLs once the router answers."""
    p_port, d_port, boot = free_port(), free_port(), free_port()
    args = ["--disagg", "1p1d", "--prefill-port", str(p_port), "--decode-port", str(d_port),
            "--bootstrap-port", str(boot), "--log-level", "warning", *extra]
    with serve_processes([args], timeout_s, env={"MC_LOG_LEVEL": "ERROR"}) as [(_, router, log_path)]:
        yield router, f"http://127.0.0.1:{p_port}", f"http://127.0.0.1:{d_port}", boot, log_path


class HeartbeatProbe:
    """Pings P's control socket (from its bootstrap /route) every 50 ms from a thread; round trips in ms."""

    def __init__(self, host: str, bootstrap_port: int):
        from specpd.disagg.bootstrap import fetch_route
        self.endpoint = fetch_route(host, bootstrap_port).zmq_endpoint
        self.rtts_ms: list[float] = []
        self.lost = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self):
        import zmq
        from specpd.disagg.messages import Heartbeat, recv_message, send_message
        sock = zmq.Context.instance().socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(self.endpoint)
        seq = 0
        while not self._stop.is_set():
            seq += 1
            sent = time.perf_counter()
            send_message(sock, Heartbeat("pd_load-probe", seq, time.time()))
            while True:  # replies to earlier, late pings are skipped
                if not sock.poll(10_000):
                    self.lost += 1
                    break
                if recv_message(sock).seq == seq:
                    self.rtts_ms.append(1000 * (time.perf_counter() - sent))
                    break
            self._stop.wait(0.05)
        sock.close(0)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join(15)

    def summary(self) -> dict:
        xs = sorted(self.rtts_ms)
        if not xs:
            return {"count": 0, "lost": self.lost}
        pick = lambda q: round(xs[min(len(xs) - 1, int(q * len(xs)))], 2)  # noqa: E731
        return {"count": len(xs), "lost": self.lost, "p50": pick(0.5), "p99": pick(0.99), "max": round(xs[-1], 2)}


@contextlib.contextmanager
def busy_loops(n: int):
    procs = [subprocess.Popen(["nice", "-n", "10", sys.executable, "-c", BUSY_LOOP]) for _ in range(n)]
    try:
        yield
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()


async def one(client: httpx.AsyncClient, url: str, prompt: list[int], max_tokens: int) -> dict:
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
    t0 = time.perf_counter()
    try:
        resp = await client.post(url + "/v1/completions", json=body)
    except httpx.HTTPError as e:
        return {"prompt_tokens": len(prompt), "error": f"transport: {e!r}", "e2e_s": time.perf_counter() - t0}
    out = {"prompt_tokens": len(prompt), "status": resp.status_code, "e2e_s": time.perf_counter() - t0}
    if resp.status_code != 200:
        try:
            out["error"] = resp.json()["error"]["message"]
        except (ValueError, KeyError, TypeError):
            out["error"] = resp.text[:300]
    else:
        out["completion_tokens"] = resp.json()["usage"]["completion_tokens"]
    return out


def burst(url: str, prompts: list[list[int]], max_tokens: int) -> list[dict]:
    async def main():
        async with httpx.AsyncClient(timeout=httpx.Timeout(1800.0)) as client:
            return await asyncio.gather(*(one(client, url, p, max_tokens) for p in prompts))
    return asyncio.run(main())


def info(url: str, timeout_s: float = 300) -> dict:
    """/server_info, waiting out a server the launcher is restarting."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return httpx.get(url + "/server_info", timeout=30).json()
        except httpx.HTTPError:
            if time.monotonic() > deadline:
                raise
            time.sleep(1.0)


def wait_pages_back(urls: list[str], timeout_s: float = 120) -> dict:
    deadline = time.monotonic() + timeout_s
    while True:
        got = {u: info(u) for u in urls}
        if all(i["free_pages"] == i["total_pages"] for i in got.values()) or time.monotonic() > deadline:
            return {u: {"free_pages": i["free_pages"], "total_pages": i["total_pages"], "pid": i["pid"]}
                    for u, i in got.items()}
        time.sleep(0.5)


def workload(tokenizer, size: int, long_len: int) -> tuple[list[list[int]], str]:
    n_long = size // 4
    short = held_out_sharegpt_prompts(tokenizer, size - n_long)
    long, source = real_text_prompts(tokenizer, n_long, long_len)
    prompts = []
    for i in range(size):  # long prompts spread through the burst, every 4th request
        prompts.append(long.pop() if i % 4 == 3 else short.pop())
    return prompts, source


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="48")
    ap.add_argument("--long-len", type=int, default=1500)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--busy", default="1", help="counts of nice'd busy loops, one case each (e.g. 0,2)")
    ap.add_argument("--serve-args", default="--speculative-algorithm eagle3 --draft-model default",
                    help="engine flags for every P and D (default timeouts and pool sizes otherwise)")
    ap.add_argument("--label", default="", help="free text recorded in the results (e.g. the commit)")
    ap.add_argument("--out", default=os.path.join(RESULTS_DIR, "pd_load.json"))
    ap.add_argument("--merge", action="append", default=[], metavar="KEY=FILE",
                    help="another run's results (this script's JSON), kept under KEY (e.g. before=OLD.json)")
    args = ap.parse_args()

    from specpd.model.loader import load_checkpoint
    tokenizer = load_checkpoint("default").tokenizer
    from specpd.machine import isa
    sizes = [int(s) for s in args.sizes.split(",")]
    loads = [int(n) for n in args.busy.split(",")]
    forced = {k: os.environ[k] for k in FORCE_AVX2 if k in os.environ}
    given = [f"--{k.replace('_', '-')} {getattr(args, k)}" for k in ("sizes", "busy", "long_len", "max_tokens")
             if getattr(args, k) != ap.get_default(k)]
    given += [f"--serve-args '{args.serve_args}'"] if args.serve_args != ap.get_default("serve_args") else []
    results = {"command": " ".join(["python -m evals.pd_load", *given]),
               "serve_command": " ".join(["specpd serve --disagg 1p1d", args.serve_args]), "label": args.label,
               "isa": isa(), "forced": forced, "max_tokens": args.max_tokens, "long_len": args.long_len,
               "machine": machine_info(), "versions": versions(), "cases": []}
    serve_args = args.serve_args.split()
    t_start = time.monotonic()
    with cluster(serve_args) as (router, p_url, d_url, boot, log_path), \
            keep_logs({"cluster": log_path}, 6000, "{name} log tail:\n"):
        log(f"cluster up in {time.monotonic() - t_start:.0f} s: router {router} P {p_url} D {d_url}")
        results["transfer_backend"] = info(p_url).get("transfer_backend")
        results["runtime"] = {role: info(url).get("runtime") for role, url in (("prefill", p_url), ("decode", d_url))}
        totals = {u: info(u)["total_pages"] for u in (p_url, d_url)}
        for size in sizes:
            prompts, source = workload(tokenizer, size, args.long_len)
            results["long_prompt_source"] = source
            for n_busy in loads:
                rtt_before = info(d_url).get("pd_heartbeat_rtt_ms", {}).get("count", 0)
                with busy_loops(n_busy), HeartbeatProbe("127.0.0.1", boot) as probe:
                    t0 = time.perf_counter()
                    outs = burst(router, prompts, args.max_tokens)
                    wall = time.perf_counter() - t0
                    rtt = info(d_url).get("pd_heartbeat_rtt_ms", {})
                pages = wait_pages_back([p_url, d_url])
                failed = [o for o in outs if "error" in o]
                errors = sorted({o["error"][:200] for o in failed})
                case = {"requests": size, "long_requests": size // 4, "busy_loops": n_busy,
                        "failed": len(failed), "errors": errors, "wall_s": round(wall, 2),
                        "e2e_s_max": round(max(o["e2e_s"] for o in outs), 2),
                        "prompt_tokens": sum(o["prompt_tokens"] for o in outs),
                        "completion_tokens": sum(o.get("completion_tokens", 0) for o in outs),
                        "pages_back": all(p["free_pages"] == totals[u] for u, p in pages.items()), "pages": pages,
                        "p_heartbeat_ms": probe.summary(), "d_heartbeat_rtt_ms": rtt,
                        "d_heartbeats_before_case": rtt_before}
                results["cases"].append(case)
                log(json.dumps({k: v for k, v in case.items() if k != "pages"}))
        with open(log_path) as f:
            results["cluster_log_tail"] = f.read()[-6000:]
    for merge in args.merge:
        key, path = merge.split("=", 1)
        with open(path) as f:
            results[key] = json.load(f)
    write_json(args.out, results)
    log(f"wrote {args.out}")
    return 0 if all(c["failed"] == 0 and c["pages_back"] for c in results["cases"]) else 1


if __name__ == "__main__":
    sys.exit(main())
