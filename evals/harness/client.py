"""The streaming OpenAI client of every served benchmark: one greedy streamed completion timed chunk by chunk
(`stream_completion`), shaped as the PD benchmarks record it (`one_request`: every token id, from
`return_tokens_as_token_ids` logprobs) or as the peers comparison does (`peer_request`: text chunks and the usage
counts, what vLLM and llama.cpp answer too); a workload of them at given arrival times, their TTFT / TPOT / τ
summary, and the deltas of the servers' KV-transfer counters and TTFT stage timings.
"""
from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field

import httpx

from evals.harness.results import log, percentile


async def sse_chunks(resp):
    """The JSON payloads of an OpenAI-style streamed response's `data: ` lines ([DONE] left out), as they arrive."""
    async for line in resp.aiter_lines():
        if line.startswith("data: ") and line != "data: [DONE]":
            yield json.loads(line[6:])


@dataclass
class Streamed:
    """One streamed completion: `t0` when it was sent, `first` / `last` when a chunk with output arrived."""
    t0: float
    first: float | None = None
    last: float | None = None
    chunks: int = 0  # chunks that carried output (a chunk may hold several tokens: speculation)
    tokens: list[int] = field(default_factory=list)  # token ids, when asked for
    usage: dict | None = None
    error: str | None = None


async def stream_completion(client: httpx.AsyncClient, base: str, prompt: list[int], max_tokens: int,
                            token_ids: bool = False, error_chars: int | None = None) -> Streamed:
    """POST a greedy streamed /v1/completions of `max_tokens` (EOS ignored, usage in the last chunk) and time its
    chunks. `token_ids`: ask for each token's id (specpd's `return_tokens_as_token_ids` logprobs) and count a chunk
    that carries ids; else a chunk that carries text. `error_chars`: cut an error chunk's message to that."""
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}
    if token_ids:
        body |= {"logprobs": 0, "return_tokens_as_token_ids": True}
    out = Streamed(t0=time.perf_counter())
    async with client.stream("POST", base + "/v1/completions", json=body) as resp:
        if resp.status_code != 200:
            out.error = f"{resp.status_code}: {(await resp.aread())[:300]!r}"
            return out
        async for chunk in sse_chunks(resp):
            if "error" in chunk:
                out.error = str(chunk["error"])[:error_chars]
                return out
            out.usage = chunk.get("usage") or out.usage
            if token_ids:
                got = [ids for choice in chunk.get("choices", [])
                       for ids in (choice.get("logprobs") or {}).get("tokens") or []]
                out.tokens += [int(t.removeprefix("token_id:")) for t in got]
            else:
                got = [choice for choice in chunk.get("choices") or [] if choice.get("text")]
            if got:
                out.last = time.perf_counter()
                out.first = out.first if out.first is not None else out.last
                out.chunks += 1
    return out


async def one_request(client: httpx.AsyncClient, url: str, prompt: list[int], max_tokens: int, delay: float) -> dict:
    """After `delay` s, one streamed completion with its token ids: a PD benchmark's row."""
    await asyncio.sleep(delay)
    s = await stream_completion(client, url, prompt, max_tokens, token_ids=True)
    if s.error is not None:
        return {"error": s.error}
    n = len(s.tokens)
    return {"prompt_tokens": len(prompt), "ttft_s": s.first - s.t0,
            "tpot_s": (s.last - s.first) / (n - 1) if n > 1 else None, "e2e_s": s.last - s.t0, "tokens": s.tokens,
            "usage": s.usage}


async def peer_request(client: httpx.AsyncClient, base: str, prompt: list[int], max_tokens: int) -> dict:
    """One streamed completion any OpenAI server answers (no token ids): a peers-comparison row."""
    try:
        s = await stream_completion(client, base, prompt, max_tokens, error_chars=300)
    except httpx.HTTPError as e:
        return {"error": f"{type(e).__name__}: {e}"}
    if s.error is not None:
        return {"error": s.error}
    if s.first is None:
        return {"error": "no tokens streamed"}
    n = (s.usage or {}).get("completion_tokens") or s.chunks  # a chunk may hold several tokens (speculation)
    return {"ttft_s": s.first - s.t0, "tpot_s": (s.last - s.first) / (n - 1) if n > 1 else None, "tokens": n,
            "chunks": s.chunks, "spec_verify_count": (s.usage or {}).get("spec_verify_count"),
            "spec_accept_length": (s.usage or {}).get("spec_accept_length")}


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
