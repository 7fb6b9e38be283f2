"""The servers of evals/prefix.py and its client: the five configurations (unified and 1P1D, prefix cache
on and off, and 1P1D with every turn on the P path) started at once, and one streamed chat request sent to one
of them with the servers' counters read before and after.
"""
from __future__ import annotations

import contextlib
import json
import time

import httpx

from evals.harness.results import log
from evals.harness.servers import free_port, keep_logs, serve_processes

CONFIGS = ("unified_on", "unified_off", "pd_on", "pd_off", "pd_on_p")
# on / off pairs compared; pd_on_p: D never prefills locally (--pd-local-prefill-tokens 0), so every turn goes
# through P's own cache and P sends the pages after D's cached prefix
PAIRS = {"unified": ("unified_on", "unified_off"), "pd": ("pd_on", "pd_off"), "pd_p": ("pd_on_p", "pd_off")}
COUNTERS = ("prompt_tokens", "prefix_cache_hit_tokens", "prefix_cache_query_tokens", "kv_bytes", "kv_transfers",
            "prefills_skipped", "pd_local_prefills", "spec_verify_count")


@contextlib.contextmanager
def cluster(engine_args: list[str]):
    """Every configuration up at once; yields {config: {"url", "servers": {role: url}}}."""
    off = ["--disable-prefix-caching"]
    boot_on, boot_off, boot_p = free_port(), free_port(), free_port()
    specs = [(["--role", "unified", *engine_args], None), (["--role", "unified", *engine_args, *off], None),
             (["--role", "prefill", "--bootstrap-port", str(boot_on), *engine_args], "0"),
             (["--role", "decode", *engine_args], "1"),
             (["--role", "prefill", "--bootstrap-port", str(boot_off), *engine_args, *off], "0"),
             (["--role", "decode", *engine_args, *off], "1"),
             (["--role", "prefill", "--bootstrap-port", str(boot_p), *engine_args], "0"),
             (["--role", "decode", "--pd-local-prefill-tokens", "0", *engine_args], "1")]
    env = {"MC_LOG_LEVEL": "ERROR"}
    with serve_processes([["--log-level", "warning", *a] for a, _ in specs], 900, cpus=[c for _, c in specs],
                         env=env) as procs:
        uon, uoff, p_on, d_on, p_off, d_off, p_p, d_p = [base for _, base, _ in procs]
        routers = [["--role", "router", "--prefill", p, "--decode", d, "--bootstrap-port", str(b)]
                   for p, d, b in ((p_on, d_on, boot_on), (p_off, d_off, boot_off), (p_p, d_p, boot_p))]
        with serve_processes([["--log-level", "warning", *a] for a in routers], 300, env=env) as rprocs, \
                keep_logs({n: path for n, (_, _, path) in zip(
                    ("unified_on", "unified_off", "pd_on/prefill", "pd_on/decode", "pd_off/prefill", "pd_off/decode",
                     "pd_on_p/prefill", "pd_on_p/decode", "pd_on/router", "pd_off/router", "pd_on_p/router"),
                    procs + rprocs)}):
            r_on, r_off, r_p = [base for _, base, _ in rprocs]
            yield {"unified_on": {"url": uon, "servers": {"unified": uon}},
                   "unified_off": {"url": uoff, "servers": {"unified": uoff}},
                   "pd_on": {"url": r_on, "servers": {"prefill": p_on, "decode": d_on}},
                   "pd_off": {"url": r_off, "servers": {"prefill": p_off, "decode": d_off}},
                   "pd_on_p": {"url": r_p, "servers": {"prefill": p_p, "decode": d_p}}}


def snapshot(target: dict) -> dict:
    return {role: httpx.get(url + "/server_info", timeout=30).json() for role, url in target["servers"].items()}


def deltas(before: dict, after: dict) -> dict:
    return {role: {k: (after[role].get(k) or 0) - (before[role].get(k) or 0) for k in COUNTERS} for role in after}


def wait_idle(target: dict, timeout_s: float = 30) -> None:
    """Until every server of the target holds no request (free + cached-unreferenced = total)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        infos = snapshot(target)
        if all(i["free_pages"] == i["total_pages"] for i in infos.values()):
            return
        time.sleep(0.05)
    log(f"   pages not back after {timeout_s} s: {target['servers']}")


# -- client ------------------------------------------------------------------------------------------
def chat(client: httpx.Client, url: str, messages: list[dict], max_tokens: int) -> dict:
    body = {"messages": messages, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}, "logprobs": True, "top_logprobs": 0}
    t0 = time.perf_counter()
    first = last = None
    text, n, usage = [], 0, None
    with client.stream("POST", url + "/v1/chat/completions", json=body) as resp:
        if resp.status_code != 200:
            return {"error": f"{resp.status_code}: {resp.read()[:300]!r}"}
        for line in resp.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                return {"error": str(chunk["error"])}
            usage = chunk.get("usage") or usage
            for choice in chunk.get("choices", []):
                got = ((choice.get("logprobs") or {}).get("content")) or []
                text.append(choice.get("delta", {}).get("content") or "")
                if got:
                    now = time.perf_counter()
                    first = first if first is not None else now
                    last, n = now, n + len(got)
    return {"ttft_s": first - t0, "e2e_s": last - t0, "text": "".join(text), "completion_tokens": n,
            "usage": usage}


FAILURES: list[dict] = []  # requests that failed and were sent again (a loaded box: see the README)


def send(client: httpx.Client, name: str, target: dict, messages: list[dict], max_tokens: int) -> dict:
    for attempt in range(2):
        before = snapshot(target)
        try:
            row = chat(client, target["url"], messages, max_tokens)
        except httpx.HTTPError as e:
            row = {"error": repr(e)}
        if "error" not in row:
            break
        log(f"   {name}: request failed ({row['error'][:200]}); {'again' if attempt == 0 else 'giving up'}")
        FAILURES.append({"config": name, "error": row["error"][:500], "at": time.strftime("%H:%M:%S")})
        wait_idle(target)
    else:
        raise RuntimeError(f"{name}: {row['error']}")
    wait_idle(target)  # P's transfer counters settle once its room is freed
    d = deltas(before, snapshot(target))
    usage = row["usage"]
    n, cached = usage["prompt_tokens"], usage["prompt_tokens_details"]["cached_tokens"]
    row.update(prompt_tokens=n, cached_tokens=cached, counters=d)
    if "unified" in d:
        row["computed_unified"] = d["unified"]["prompt_tokens"] - d["unified"]["prefix_cache_hit_tokens"]
    else:
        p, dd = d["prefill"], d["decode"]
        row["computed_p"] = p["prompt_tokens"] - p["prefix_cache_hit_tokens"]
        row["local_prefill"] = bool(dd["pd_local_prefills"])
        # D's engine counts the hit of a request it prefills itself; a prebuilt one's hit is D's cached prefix
        row["d_cached_tokens"] = dd["prefix_cache_hit_tokens"]
        row["computed_d"] = n - dd["prefix_cache_hit_tokens"] if row["local_prefill"] else 0
        row["kv_bytes"] = p["kv_bytes"]
    return row


def flush(client, targets) -> None:
    for target in targets.values():
        resp = client.post(target["url"] + "/flush_cache")
        assert resp.status_code == 200, resp.text
