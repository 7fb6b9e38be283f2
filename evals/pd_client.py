"""The streaming client of the PD benchmarks (evals/bench_pd.py, bench_pd_interleaved.py, bench_pd_ttft.py): one
greedy streamed completion timed token by token, a workload of them at given arrival times, their TTFT / TPOT /
tau summary, and the deltas of the servers' KV-transfer counters and TTFT stage timings.
"""
from __future__ import annotations

import asyncio
import time

import httpx
from common import log, percentile, sse_chunks


async def one_request(client: httpx.AsyncClient, url: str, prompt: list[int], max_tokens: int, delay: float) -> dict:
    await asyncio.sleep(delay)
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}, "logprobs": 0,
            "return_tokens_as_token_ids": True}
    t0 = time.perf_counter()
    first = last = None
    tokens: list[int] = []
    usage = None
    async with client.stream("POST", url + "/v1/completions", json=body) as resp:
        if resp.status_code != 200:
            return {"error": f"{resp.status_code}: {(await resp.aread())[:300]!r}"}
        async for chunk in sse_chunks(resp):
            if "error" in chunk:
                return {"error": str(chunk["error"])}
            if chunk.get("usage"):
                usage = chunk["usage"]
            for choice in chunk.get("choices", []):
                got = (choice.get("logprobs") or {}).get("tokens") or []
                if got:
                    now = time.perf_counter()
                    first = first if first is not None else now
                    last = now
                    tokens += [int(t.removeprefix("token_id:")) for t in got]
    n = len(tokens)
    return {"prompt_tokens": len(prompt), "ttft_s": first - t0, "tpot_s": (last - first) / (n - 1) if n > 1 else None,
            "e2e_s": last - t0, "tokens": tokens, "usage": usage}


def stage_snapshot(urls: list[str]) -> dict:
    """The TTFT breakdown (specpd/disagg/timeline.py) of the router, P and D: {stage: {count, sum_s, p50_ms, ...}}."""
    merged = {}
    for url in urls:
        merged.update(httpx.get(url + "/server_info").json().get("pd_stages") or {})
    return merged


def stage_breakdown(before: dict, after: dict) -> dict:
    """Per stage over one workload: mean from the count and sum deltas (exact for the workload), p50 / p99 from
    each server's recent window as of `after` (the workloads before it included)."""
    out = {}
    for stage, a in after.items():
        b = before.get(stage, {"count": 0, "sum_s": 0.0})
        n = a["count"] - b["count"]
        if n > 0:
            out[stage] = {"count": n, "mean_ms": round(1000 * (a["sum_s"] - b["sum_s"]) / n, 3),
                          "p50_ms_window": a["p50_ms"], "p99_ms_window": a["p99_ms"]}
    return out


def log_breakdown(title: str, breakdown: dict) -> None:
    log(f"   TTFT breakdown, {title} (each stage on its own server's clock; mean / p50 / p99 ms, count):")
    for stage, v in breakdown.items():
        log(f"     {stage:22s} {v['mean_ms']:9.2f} {v['p50_ms_window']:9.2f} {v['p99_ms_window']:9.2f}  {v['count']}")


def run_workload(url: str, prompts: list[list[int]], delays: list[float], max_tokens: int) -> list[dict]:
    async def main():
        async with httpx.AsyncClient(timeout=httpx.Timeout(1800.0)) as client:
            return await asyncio.gather(*(one_request(client, url, p, max_tokens, d) for p, d in zip(prompts, delays)))
    return asyncio.run(main())


def summarize(rows: list[dict], which: list[int] | None = None) -> dict:
    picked = [rows[i] for i in (which if which is not None else range(len(rows)))]
    errors = [r["error"] for r in picked if "error" in r]
    ok = [r for r in picked if "error" not in r]
    ttft, tpot = [r["ttft_s"] for r in ok], [r["tpot_s"] for r in ok if r["tpot_s"] is not None]
    out = {"requests": len(picked), "errors": errors[:3], "num_errors": len(errors),
           "ttft_p50_s": percentile(ttft, 0.5), "ttft_p99_s": percentile(ttft, 0.99),
           "tpot_p50_s": percentile(tpot, 0.5), "tpot_p99_s": percentile(tpot, 0.99)}
    verify = sum((r["usage"] or {}).get("spec_verify_count") or 0 for r in ok)
    if verify:
        committed = sum(((r["usage"] or {}).get("spec_accept_length") or 0) * ((r["usage"] or {}).get("spec_verify_count") or 0)
                        for r in ok)
        out["tau"] = committed / verify
        out["spec_verify_count"] = verify
    return out


def kv_delta(before: dict, after: dict) -> dict:
    keys = ("kv_transfers", "kv_bytes", "kv_transfer_s", "kv_descriptors", "kv_calls")
    d = {k: after.get(k, 0) - before.get(k, 0) for k in keys}
    d["mb_per_s"] = d["kv_bytes"] / d["kv_transfer_s"] / 1e6 if d["kv_transfer_s"] else None
    d["descriptors_per_request"] = d["kv_descriptors"] / d["kv_transfers"] if d["kv_transfers"] else None
    d["bytes_per_request"] = d["kv_bytes"] / d["kv_transfers"] if d["kv_transfers"] else None
    return d
