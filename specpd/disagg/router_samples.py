"""n > 1 through the router. P and D take one sample a request, so the router splits a request of n parallel
samples into n requests of one (`child_bodies`: n=1, a seeded request's sample i on seed + i, as a unified server's
and vLLM's) and merges their answers into the one a unified server gives:
  1. The first sample goes alone until P has handed its KV off: its prompt's pages are then in P's prefix cache,
     and the others, sent next, prefill only what is past them (router.py's `fan_out`).
  2. Not streamed: one body, the samples' choices under their index, `usage` with the prompt counted once and
     the completion tokens and acceptance counts summed (`merge_bodies`). A sample that failed fails the request
     with its error.
  3. Streamed: every sample's chunks relayed as they come, each under its choice's index; their usage chunks
     held back and sent merged at the end, then one [DONE] (`merge_streams`).
No torch here.
"""
from __future__ import annotations

import asyncio
import json
from typing import Any, AsyncIterator

MAX_N = 128  # as a unified server's (specpd/server/protocol.py)
SEED_MIN, SEED_SPAN = -(1 << 63), 1 << 64  # the generator's seeds; sample i's wraps into them


def samples(body: dict) -> int | None:
    """How many samples the router splits this request into, or None: it goes through whole (n absent, 1, or not
    an integer: P and D answer that with the 400 naming it)."""
    n = body.get("n")
    if isinstance(n, int) and not isinstance(n, bool) and n > 1:
        return n
    return None


def child_bodies(body: dict, n: int) -> list[dict]:
    seed = body.get("seed")
    seeded = isinstance(seed, int) and not isinstance(seed, bool)
    return [{**body, "n": 1, **({"seed": (seed + i - SEED_MIN) % SEED_SPAN + SEED_MIN} if seeded and i else {})}
            for i in range(n)]


def merged_usage(usages: list[dict]) -> dict:
    first = usages[0]
    out = {**first, "completion_tokens": sum(u.get("completion_tokens", 0) for u in usages)}
    out["total_tokens"] = first.get("prompt_tokens", 0) + out["completion_tokens"]
    if "spec_verify_count" in first:
        verify = sum(u.get("spec_verify_count") or 0 for u in usages)
        out["spec_verify_count"] = verify
        out["spec_accepted_tokens"] = sum(u.get("spec_accepted_tokens") or 0 for u in usages)
        committed = sum((u.get("spec_accept_length") or 0) * (u.get("spec_verify_count") or 0) for u in usages)
        out["spec_accept_length"] = committed / verify if verify else None
    return out


def merge_bodies(bodies: list[dict]) -> dict:
    """The samples' non-streamed bodies as one: the first's envelope, every sample's choice under its index."""
    merged = dict(bodies[0])
    merged["choices"] = [{**b["choices"][0], "index": i} for i, b in enumerate(bodies)]
    if all(isinstance(b.get("usage"), dict) for b in bodies):
        merged["usage"] = merged_usage([b["usage"] for b in bodies])
    return merged


async def merge_streams(streams: list[AsyncIterator[bytes]]) -> AsyncIterator[bytes]:
    """The samples' SSE streams as one (module docstring, 3). Closing it closes them all."""
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(i: int, stream: AsyncIterator[bytes]) -> None:
        buffer = b""
        try:
            async for chunk in stream:
                buffer += chunk
                while b"\n\n" in buffer:
                    event, buffer = buffer.split(b"\n\n", 1)
                    queue.put_nowait((i, event))
        finally:
            queue.put_nowait((i, None))

    tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
    usages: list[dict | None] = [None] * len(streams)  # each sample's usage chunk
    try:
        open_streams = len(streams)
        while open_streams:
            i, event = await queue.get()
            if event is None:
                open_streams -= 1
                continue
            out = _reindexed(event, i, usages)
            if out is not None:
                yield out + b"\n\n"
        if all(u is not None for u in usages):
            last = {**usages[0], "usage": merged_usage([u["usage"] for u in usages])}
            yield b"data: " + json.dumps(last, ensure_ascii=False).encode() + b"\n\n"
        yield b"data: [DONE]\n\n"
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for s in streams:
            aclose = getattr(s, "aclose", None)
            if aclose is not None:
                await aclose()


def _reindexed(event: bytes, index: int, usages: list[dict | None]) -> bytes | None:
    """One SSE event of sample `index` as the merged stream carries it: its choices under that index; its usage
    chunk kept for the end and its [DONE] dropped (None); anything else (an error event) as it came."""
    if not event.startswith(b"data: "):
        return event
    data = event[len(b"data: "):]
    if data.strip() == b"[DONE]":
        return None
    try:
        payload: Any = json.loads(data)
    except json.JSONDecodeError:
        return event
    if not isinstance(payload, dict) or "choices" not in payload:
        return event
    if not payload["choices"] and isinstance(payload.get("usage"), dict):
        usages[index] = payload
        return None
    for choice in payload["choices"]:
        choice["index"] = index
    return b"data: " + json.dumps(payload, ensure_ascii=False).encode()
