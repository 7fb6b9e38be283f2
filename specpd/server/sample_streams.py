"""A request's parallel samples (n > 1) as one response: each sample is an engine request of its own (the
first's id with "-i"; seeded ones draw from seed + i), their outputs merged in arrival order under their choice
index (`merged`), or collected for a non-streaming body while a watcher listens for the client leaving
(`collect`). A single sample (n = 1) goes through the same functions without a task of its own.
"""
from __future__ import annotations

import asyncio
import dataclasses
from typing import Callable

from starlette.requests import Request

from specpd.core import SEED_MIN, RequestOutput, SamplingParams
from specpd.server.async_engine import RequestStream


def nth_sample(params: SamplingParams, i: int) -> SamplingParams:
    """The i-th parallel sample's params: a seeded request's samples draw from seed + i (vLLM's rule), wrapped
    into the generator's 64 bits."""
    if i == 0 or params.seed is None:
        return params
    return dataclasses.replace(params, seed=(params.seed + i - SEED_MIN) % (1 << 64) + SEED_MIN)


async def merged(streams: list[RequestStream]):
    """(index, output) from every stream as each comes; the first stream error is raised once they end."""
    if len(streams) == 1:
        async for out in streams[0]:
            yield 0, out
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(i: int, stream: RequestStream) -> None:
        try:
            async for out in stream:
                queue.put_nowait((i, out))
        except Exception as exc:  # noqa: BLE001 - re-raised below, in the consumer
            queue.put_nowait((i, exc))
        queue.put_nowait((i, None))

    tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
    try:
        open_streams, error = len(streams), None
        while open_streams:
            i, item = await queue.get()
            if item is None:
                open_streams -= 1
            elif isinstance(item, Exception):
                error = error or item
            else:
                yield i, item
        if error is not None:
            raise error
    finally:
        for t in tasks:
            t.cancel()


async def collect(raw: Request, streams: list[RequestStream], abort: Callable[[list[str]], None]
                  ) -> list[list[RequestOutput]] | None:
    """Every output of each of a non-streaming request's samples; None if the client hung up first (then
    they are aborted)."""
    outputs: list[list[RequestOutput]] = [[] for _ in streams]

    async def consume():
        async for i, out in merged(streams):
            outputs[i].append(out)

    consumer = asyncio.ensure_future(consume())
    watcher = asyncio.ensure_future(_client_disconnected(raw))
    try:
        done, _ = await asyncio.wait({consumer, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not consumer.done():  # the client hung up (or this handler was cancelled)
            consumer.cancel()
            abort([s.request_id for s in streams])
    if consumer not in done:
        return None
    consumer.result()  # re-raises EngineDeadError
    return outputs


async def _client_disconnected(raw: Request) -> None:
    """Returns when the client closes the connection (the body has been read, so receive() waits)."""
    while True:
        message = await raw.receive()
        if message["type"] == "http.disconnect":
            return
