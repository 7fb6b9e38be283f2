"""Soak: a bounded mixed-load run through a 1P1D speculative cluster that this script starts itself.

  python evals/soak.py                  # 30 min of load -> evals/results/soak.json, evals/results/soak.png
  python evals/soak.py --minutes 8      # a short run

The cluster: `specpd serve --disagg 1p1d --model default --speculative-algorithm eagle3 --draft-model default`
(plus --serve-args) as a child process on free 127.0.0.1 ports, `--max-request-bytes` set small (1 MiB by
default) so oversized bodies stay cheap. Load, all through the router over HTTP, at most --max-inflight
requests at once (an arrival that finds the bound full waits for a slot; counted as `arrivals_waited`):
Poisson arrivals at --rate req/s, each request one of
  ok          /v1/completions, held-out ShareGPT first turn (chat template) or (--long-frac) a --long-len-token
              ShareGPT text; streamed (--stream-frac, with include_usage) or not; greedy or temperature 0.8;
              ignore_eos; must answer 200 (a stream: chunks then [DONE], no error event) -> completed / failed
  disconnect  (--disconnect-frac) a stream the client closes after 1-3 chunks: expected, pages must come back
  abort       (--abort-frac) a non-streamed request the client gives up on after 0.3-3 s: expected
  bad         (--bad-frac) a malformed request (negative max_tokens, wrong types, bad JSON, out-of-vocab id,
              missing prompt, ...): expected 400; any other answer is a failure
  oversize    (--oversize-frac) a body 1.25x --max-request-bytes: expected 413
A request with no answer at all within --lost-after s (the client's bound) is `lost`, not `failed`.
At the deadline arrivals stop; in-flight requests drain (each still bounded by --lost-after); then P's and
D's free pages are polled (read through the router's /server_info and from each server) for up to 30 s:
leaked = total - free at the end. RSS (VmRSS) of the launcher, P, D and router is sampled every 10 s;
growth is reported from the first sample after the warm-up (the first 20% of the load) to the last one.
TTFT / TPOT p50 / p90 / p99 over the streamed successes (TPOT: (last token chunk - first) / (tokens - 1)).
Then SIGINT to the launcher (SIGKILL to its process group after 30 s).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time

EVALS_DIR = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(EVALS_DIR)
sys.path[:0] = [EVALS_DIR, REPO]
from common import held_out_sharegpt_prompts, log, machine_info, real_text_prompts, versions, write_json  # noqa: E402

import httpx  # noqa: E402

from specpd.server.launch import free_port  # noqa: E402

RESULTS_DIR = os.path.join(EVALS_DIR, "results")
BASE_CMD = ["--disagg", "1p1d", "--model", "default", "--speculative-algorithm", "eagle3", "--draft-model", "default"]
EXPECTED = ("disconnect", "abort", "bad", "oversize")


# ---------------------------------------------------------------- cluster

def start_cluster(args, log_file):
    port, p_port, d_port, boot = free_port(), free_port(), free_port(), free_port()
    cmd = [sys.executable, "-m", "specpd", "serve", *BASE_CMD, "--host", "127.0.0.1", "--port", str(port),
           "--prefill-port", str(p_port), "--decode-port", str(d_port), "--bootstrap-port", str(boot),
           "--max-request-bytes", str(args.max_request_bytes), "--log-level", "warning", *args.serve_args.split()]
    env = {**os.environ, "PYTHONPATH": REPO + os.pathsep + os.environ.get("PYTHONPATH", ""),
           "OPENBLAS_NUM_THREADS": "1", "MC_LOG_LEVEL": "ERROR"}
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log_file, stderr=subprocess.STDOUT,
                            start_new_session=True)
    urls = {"router": f"http://127.0.0.1:{port}", "prefill": f"http://127.0.0.1:{p_port}",
            "decode": f"http://127.0.0.1:{d_port}"}
    return proc, cmd, urls


def wait_ready(proc, router: str, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"launcher exited with {proc.returncode}")
        try:
            if httpx.get(router + "/health", timeout=5).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(1.0)
    raise RuntimeError(f"cluster not healthy after {timeout_s} s")


def stop_cluster(proc) -> dict:
    t0 = time.monotonic()
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(30)
            how = "SIGINT"
        except subprocess.TimeoutExpired:
            how = "SIGKILL (no exit 30 s after SIGINT)"
    else:
        how = f"already exited ({proc.returncode})"
    try:  # anything of its group still alive (children it did not reap)
        os.killpg(proc.pid, signal.SIGKILL)
        if how == "SIGINT":
            how = "SIGINT (process-group leftovers then SIGKILLed)"
    except (ProcessLookupError, PermissionError):
        pass
    proc.wait()
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


# ---------------------------------------------------------------- requests

def err_head(resp_text: str, status: int | None) -> str:
    msg = resp_text
    try:
        j = json.loads(resp_text)
        msg = j.get("error", {}).get("message", resp_text) if isinstance(j, dict) else resp_text
    except (ValueError, AttributeError):
        pass
    return f"{status} {str(msg)[:120]}"


def bad_bodies(prompt: list[int], vocab: int) -> list[tuple[str, str, bytes | dict]]:
    """(name, path, body) of requests the API must refuse with 400."""
    return [
        ("negative max_tokens", "/v1/completions", {"prompt": prompt, "max_tokens": -5}),
        ("max_tokens string", "/v1/completions", {"prompt": prompt, "max_tokens": "ten"}),
        ("prompt int", "/v1/completions", {"prompt": 12345, "max_tokens": 8}),
        ("temperature string", "/v1/completions", {"prompt": prompt, "max_tokens": 8, "temperature": "hot"}),
        ("missing prompt", "/v1/completions", {"max_tokens": 8}),
        ("out-of-vocab id", "/v1/completions", {"prompt": [vocab + 1000], "max_tokens": 8}),
        ("invalid JSON", "/v1/completions", b'{"prompt": [1, 2, '),
        ("messages not a list", "/v1/chat/completions", {"messages": "hello", "max_tokens": 8}),
        ("negative top_p", "/v1/completions", {"prompt": prompt, "max_tokens": 8, "top_p": -1}),
    ]


class Load:
    def __init__(self, args, router: str, short: list, long: list, vocab: int, t0: float):
        self.args, self.router, self.short, self.long, self.vocab, self.t0 = args, router, short, long, vocab, t0
        self.records: list[dict] = []
        self.rng = random.Random(args.seed)

    def now(self) -> float:
        return time.monotonic() - self.t0

    def pick(self) -> str:
        a, x = self.args, self.rng.random()
        for kind, frac in (("disconnect", a.disconnect_frac), ("abort", a.abort_frac), ("bad", a.bad_frac),
                           ("oversize", a.oversize_frac)):
            if x < frac:
                return kind
            x -= frac
        return "ok"

    def body(self) -> tuple[dict, bool]:
        long = self.rng.random() < self.args.long_frac
        prompt = self.rng.choice(self.long if long else self.short)
        body = {"prompt": prompt, "max_tokens": self.args.max_tokens_long if long else self.args.max_tokens,
                "ignore_eos": True, "temperature": 0 if self.rng.random() < 0.7 else 0.8}
        return body, long

    async def run_one(self, client: httpx.AsyncClient, kind: str) -> None:
        rec = {"kind": kind, "t_start": round(self.now(), 3)}
        self.records.append(rec)
        try:
            await asyncio.wait_for(self._do(client, kind, rec), self.args.lost_after)
        except asyncio.TimeoutError:
            rec.update(outcome="lost", reason=f"no answer within {self.args.lost_after} s")
        except Exception as e:  # noqa: BLE001 -- a client-side bug is recorded, never stops the soak
            rec.update(outcome="failed", reason=f"client exception {e!r}"[:160])
        rec["t_end"] = round(self.now(), 3)

    async def _do(self, client: httpx.AsyncClient, kind: str, rec: dict) -> None:
        url = self.router
        if kind == "bad":
            name, path, body = self.rng.choice(bad_bodies(self.rng.choice(self.short)[:16], self.vocab))
            rec["case"] = name
            kw = {"content": body, "headers": {"content-type": "application/json"}} if isinstance(body, bytes) \
                else {"json": body}
            try:
                resp = await client.post(url + path, **kw)
            except httpx.HTTPError as e:
                rec.update(outcome="failed", reason=f"bad input '{name}': transport {e!r}"[:160])
                return
            if resp.status_code == 400:
                rec.update(outcome="expected", reason="400")
            else:
                rec.update(outcome="failed", reason=f"bad input '{name}' answered {err_head(resp.text, resp.status_code)}")
            return
        if kind == "oversize":
            n = int(self.args.max_request_bytes * 1.25)
            data = b'{"max_tokens": 4, "prompt": "' + b"a" * n + b'"}'
            try:
                resp = await client.post(url + "/v1/completions", content=data,
                                         headers={"content-type": "application/json"})
            except httpx.HTTPError as e:  # a server may close the socket after its 413 while we still send
                rec.update(outcome="failed", reason=f"oversize: transport {e!r}"[:160])
                return
            if resp.status_code == 413:
                rec.update(outcome="expected", reason="413")
            else:
                rec.update(outcome="failed", reason=f"oversize answered {err_head(resp.text, resp.status_code)}")
            return
        body, long = self.body()
        rec.update(long=long, prompt_tokens=len(body["prompt"]))
        if kind == "abort":
            give_up = self.rng.uniform(0.3, 3.0)
            rec["give_up_s"] = round(give_up, 2)
            try:
                resp = await client.post(url + "/v1/completions", json=body, timeout=httpx.Timeout(give_up))
            except httpx.TimeoutException:
                rec.update(outcome="expected", reason="client timeout")
                return
            except httpx.HTTPError as e:
                rec.update(outcome="failed", reason=f"abort: transport {e!r}"[:160])
                return
            rec.update(outcome="completed" if resp.status_code == 200 else "failed",
                       reason=None if resp.status_code == 200 else err_head(resp.text, resp.status_code))
            if resp.status_code == 200:
                rec["note"] = "answered before the client gave up"
            return
        stream = kind == "disconnect" or self.rng.random() < self.args.stream_frac
        rec["stream"] = stream
        if not stream:
            t0 = time.perf_counter()
            try:
                resp = await client.post(url + "/v1/completions", json=body)
            except httpx.HTTPError as e:
                rec.update(outcome="failed", reason=f"transport {e!r}"[:160])
                return
            rec["e2e_s"] = round(time.perf_counter() - t0, 3)
            if resp.status_code == 200:
                rec.update(outcome="completed", completion_tokens=resp.json()["usage"]["completion_tokens"])
            else:
                rec.update(outcome="failed", reason=err_head(resp.text, resp.status_code))
            return
        body = {**body, "stream": True, "stream_options": {"include_usage": True}}
        cut_after = self.rng.randint(1, 3) if kind == "disconnect" else None
        t0 = time.perf_counter()
        t_first = t_last = None
        chunks = tokens = 0
        done = False
        try:
            async with client.stream("POST", url + "/v1/completions", json=body) as resp:
                if resp.status_code != 200:
                    text = (await resp.aread()).decode(errors="replace")
                    rec.update(outcome="failed", reason=err_head(text, resp.status_code))
                    return
                async for line in resp.aiter_lines():
                    if not line.startswith("data: "):
                        continue
                    data = line[6:]
                    if data == "[DONE]":
                        done = True
                        break
                    obj = json.loads(data)
                    if "error" in obj:
                        rec.update(outcome="failed",
                                   reason=f"stream error event: {str(obj['error'].get('message'))[:120]}")
                        return
                    if obj.get("usage") and not obj.get("choices"):
                        tokens = obj["usage"]["completion_tokens"]
                        continue
                    if obj.get("choices"):
                        t = time.perf_counter()
                        t_first = t_first or t
                        t_last = t
                        chunks += 1
                    if cut_after is not None and chunks >= cut_after:
                        rec.update(outcome="expected", reason="client disconnected mid-stream", chunks=chunks)
                        return  # leaving the block closes the connection
        except httpx.HTTPError as e:
            rec.update(outcome="failed", reason=f"stream transport {e!r}"[:160])
            return
        if cut_after is not None:
            rec.update(outcome="expected", reason="stream ended before the client disconnected", chunks=chunks)
            return
        if not done:
            rec.update(outcome="failed", reason="stream ended without [DONE]")
            return
        rec.update(outcome="completed", chunks=chunks, completion_tokens=tokens, e2e_s=round(time.perf_counter() - t0, 3))
        if t_first is not None:
            rec["ttft_s"] = round(t_first - t0, 4)
            if tokens > 1:
                rec["tpot_s"] = round((t_last - t_first) / (tokens - 1), 5)

    async def run(self, load_seconds: float) -> dict:
        sem = asyncio.Semaphore(self.args.max_inflight)
        tasks: set[asyncio.Task] = set()
        waited = 0
        limits = httpx.Limits(max_connections=self.args.max_inflight + 4, max_keepalive_connections=self.args.max_inflight)
        async with httpx.AsyncClient(timeout=httpx.Timeout(self.args.lost_after), limits=limits) as client:
            async def guarded(kind):
                try:
                    await self.run_one(client, kind)
                finally:
                    sem.release()
            next_t = self.now()
            while True:
                next_t += self.rng.expovariate(self.args.rate)
                if next_t >= load_seconds:
                    break
                await asyncio.sleep(max(0.0, next_t - self.now()))
                if sem.locked():
                    waited += 1
                await sem.acquire()
                if self.now() >= load_seconds:
                    sem.release()
                    break
                task = asyncio.create_task(guarded(self.pick()))
                tasks.add(task)
                task.add_done_callback(tasks.discard)
            t_drain = self.now()
            log(f"deadline: arrivals stopped at {t_drain:.0f} s, {len(tasks)} in flight, draining")
            if tasks:
                await asyncio.wait(set(tasks), timeout=self.args.lost_after + 30)
        return {"arrivals_waited_for_slot": waited, "load_end_s": round(t_drain, 1),
                "drain_s": round(self.now() - t_drain, 1)}


# ---------------------------------------------------------------- report

def pct(xs: list[float]) -> dict:
    xs = sorted(xs)
    if not xs:
        return {"count": 0}
    pick = lambda q: xs[min(len(xs) - 1, int(q * len(xs)))]  # noqa: E731
    return {"count": len(xs), "p50": round(pick(0.5), 4), "p90": round(pick(0.9), 4), "p99": round(pick(0.99), 4),
            "max": round(xs[-1], 4)}


def summarize(records: list[dict]) -> dict:
    from collections import Counter
    by = Counter(r.get("outcome", "unfinished") for r in records)
    failed = Counter(r["reason"] for r in records if r.get("outcome") == "failed")
    expected = Counter(f"{r['kind']}: {r['reason']}" for r in records if r.get("outcome") == "expected")
    lost = [r for r in records if r.get("outcome") in ("lost", None)]
    ok = [r for r in records if r.get("outcome") == "completed" and r["kind"] in ("ok", "abort")]
    streamed = [r for r in ok if r.get("stream")]
    return {
        "sent": len(records), "completed": by["completed"], "expected_refusals": by["expected"],
        "failed": by["failed"], "lost": len(lost), "by_kind": dict(Counter(r["kind"] for r in records)),
        "failed_by_reason": dict(failed.most_common()), "expected_by_reason": dict(expected.most_common()),
        "lost_requests": [{k: r.get(k) for k in ("kind", "t_start", "long", "stream", "reason")} for r in lost],
        "completed_long": sum(1 for r in ok if r.get("long")), "completed_streamed": len(streamed),
        "completion_tokens": sum(r.get("completion_tokens", 0) for r in ok),
        "ttft_s": pct([r["ttft_s"] for r in streamed if "ttft_s" in r]),
        "ttft_s_short": pct([r["ttft_s"] for r in streamed if "ttft_s" in r and not r.get("long")]),
        "ttft_s_long": pct([r["ttft_s"] for r in streamed if "ttft_s" in r and r.get("long")]),
        "tpot_s": pct([r["tpot_s"] for r in streamed if "tpot_s" in r]),
        "e2e_s_non_streamed": pct([r["e2e_s"] for r in ok if not r.get("stream") and "e2e_s" in r]),
    }


def plot(path: str, rss_samples: list[dict], records: list[dict], warmup_t: float, load_end: float) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, (a1, a2) = plt.subplots(2, 1, figsize=(10, 7), sharex=True)
    a1b = a1.twinx()  # P and D (GiB-sized) on the left, the router and launcher (tens of MiB) on the right
    for (role, color), ax in zip((("prefill", "tab:blue"), ("decode", "tab:orange"), ("router", "tab:green"),
                                  ("launcher", "tab:purple")), (a1, a1, a1b, a1b)):
        pts = [(s["t"], s[role]["rss_mb"]) for s in rss_samples if role in s and s[role]["rss_mb"] is not None]
        if pts:
            ax.plot([p[0] / 60 for p in pts], [p[1] for p in pts], marker=".", color=color, label=role)
    a1.set_ylabel("VmRSS (MiB): prefill, decode")
    a1b.set_ylabel("VmRSS (MiB): router, launcher")
    h1, l1 = a1.get_legend_handles_labels()
    h2, l2 = a1b.get_legend_handles_labels()
    a1.legend(h1 + h2, l1 + l2, loc="center right")
    a1.set_title("specpd 1P1D EAGLE-3 soak: RSS per process")
    for ax in (a1, a2):
        ax.axvline(warmup_t / 60, color="grey", ls="--", lw=0.8)
        ax.axvline(load_end / 60, color="black", ls=":", lw=0.8)
    bin_s = 30.0
    n_bins = int(max([r.get("t_end", r["t_start"]) for r in records] + [load_end]) // bin_s) + 1
    cats = [("completed", "tab:green"), ("expected", "tab:blue"), ("failed", "tab:red"), ("lost", "black")]
    bottom = [0] * n_bins
    xs = [(i * bin_s + bin_s / 2) / 60 for i in range(n_bins)]
    for cat, color in cats:
        counts = [0] * n_bins
        for r in records:
            if r.get("outcome", "lost") == cat:
                counts[int(r.get("t_end", r["t_start"]) // bin_s)] += 1
        a2.bar(xs, counts, width=bin_s / 60 * 0.9, bottom=bottom, color=color, label=cat)
        bottom = [b + c for b, c in zip(bottom, counts)]
    a2.set_ylabel(f"requests ended per {bin_s:.0f} s")
    a2.set_xlabel("minutes since load start (dashed: end of warm-up, dotted: deadline)")
    a2.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


# ---------------------------------------------------------------- main

def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--minutes", type=float, default=30.0, help="load duration (then drain and stop)")
    ap.add_argument("--rate", type=float, default=0.3, help="Poisson arrival rate, requests/s")
    ap.add_argument("--max-inflight", type=int, default=16)
    ap.add_argument("--long-frac", type=float, default=0.15)
    ap.add_argument("--long-len", type=int, default=2000)
    ap.add_argument("--stream-frac", type=float, default=0.5)
    ap.add_argument("--disconnect-frac", type=float, default=0.05)
    ap.add_argument("--abort-frac", type=float, default=0.03)
    ap.add_argument("--bad-frac", type=float, default=0.04)
    ap.add_argument("--oversize-frac", type=float, default=0.02)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--max-tokens-long", type=int, default=32)
    ap.add_argument("--max-request-bytes", type=int, default=1 << 20, help="passed to the cluster")
    ap.add_argument("--lost-after", type=float, default=300.0, help="no answer within this: lost")
    ap.add_argument("--serve-args", default="", help="extra flags for `specpd serve --disagg`")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=os.path.join(RESULTS_DIR, "soak.json"))
    ap.add_argument("--png", default=os.path.join(RESULTS_DIR, "soak.png"))
    args = ap.parse_args()

    from specpd.model.loader import load_checkpoint
    tokenizer = load_checkpoint("default").tokenizer
    vocab = tokenizer.vocab_size() if callable(tokenizer.vocab_size) else tokenizer.vocab_size
    short = held_out_sharegpt_prompts(tokenizer, 400)
    log_file = tempfile.NamedTemporaryFile("w+", prefix="specpd-soak-", suffix=".log", delete=False)
    t_boot = time.monotonic()
    proc, cmd, urls = start_cluster(args, log_file)
    results = {"command": " ".join(["python", "evals/soak.py", *sys.argv[1:]]),
               "cluster_command": " ".join(["specpd", *cmd[cmd.index("serve"):]]), "args": vars(args),
               "machine": machine_info(), "versions": versions()}
    code = 1
    try:
        wait_ready(proc, urls["router"], 900)
        results["cluster_up_s"] = round(time.monotonic() - t_boot, 1)
        log(f"cluster up in {results['cluster_up_s']} s: {urls}")
        p_info = server_info(urls["prefill"]) or {}
        max_len = p_info.get("max_model_len") or 4096
        long_len = min(args.long_len, max_len - args.max_tokens_long - 8)
        long, source = real_text_prompts(tokenizer, 40, long_len)
        results.update(long_len=long_len, long_prompt_source=source, max_model_len=max_len,
                       transfer_backend=p_info.get("transfer_backend"),
                       pages_at_start={r: {k: (server_info(urls[r]) or {}).get(k) for k in ("free_pages", "total_pages")}
                                       for r in ("prefill", "decode")})
        load_s = args.minutes * 60
        t0 = time.monotonic()
        results["load_start_utc"] = time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime())
        rss = RssSampler(proc.pid, t0)
        rss.start()
        load = Load(args, urls["router"], short, long, vocab, t0)
        run_info = asyncio.run(load.run(load_s))
        results["run"] = run_info
        results["drained_utc"] = time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime())
        results["pages_after_drain"] = pages_after_drain(urls)
        rss.stop()
        results["cluster_pids"] = roles_of(proc.pid)
        warmup_t = 0.2 * load_s
        results["rss"] = rss.summary(warmup_t)
        results["rss_samples"] = rss.samples
        results["summary"] = summarize(load.records)
        results["records"] = load.records
        s = results["summary"]
        code = 0 if (s["failed"] == 0 and s["lost"] == 0
                     and all(p["leaked_pages"] == 0 for p in results["pages_after_drain"].values())) else 1
        os.makedirs(os.path.dirname(args.png), exist_ok=True)
        plot(args.png, rss.samples, load.records, warmup_t, run_info["load_end_s"])
    finally:
        results["shutdown_start_utc"] = time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime())
        results["shutdown"] = stop_cluster(proc)
        log_file.flush()
        with open(log_file.name) as f:
            text = f.read()
        results["cluster_log_tail"] = text[-8000:]
        # every timestamped WARNING/ERROR line of the whole run, to place them against the load's wall clock
        results["cluster_log_problems"] = {
            "count_task_exception_never_retrieved": text.count("Task exception was never retrieved"),
            "count_traceback": text.count("Traceback (most recent call last)"),
            "lines": re.findall(r"^\d{4}-\d\d-\d\d [\d:,]+ (?:WARNING|ERROR|CRITICAL) .*$", text, re.M)[:200]}
        log_file.close()
        os.unlink(log_file.name)
        write_json(args.out, results)
        log(f"wrote {args.out}")
    s = results.get("summary", {})
    log(json.dumps({k: s.get(k) for k in ("sent", "completed", "expected_refusals", "failed", "lost",
                                          "failed_by_reason", "ttft_s", "tpot_s")}))
    log(json.dumps({"pages_after_drain": results.get("pages_after_drain"),
                    "rss_growth_pct": {r: v.get("growth_after_warmup_pct") for r, v in results.get("rss", {}).items()},
                    "shutdown": results["shutdown"]}))
    return code


if __name__ == "__main__":
    sys.exit(main())
