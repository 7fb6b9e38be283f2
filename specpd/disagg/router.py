"""The PD router: one OpenAI endpoint in front of a prefill server (P) and a decode server (D). No torch.

A request's life in the router:
  1. Draw a random 63-bit `bootstrap_room`; add `bootstrap_host`, `bootstrap_port` (P's bootstrap server)
     and the room to the JSON body.
  2. Send it to P (as stream=false: P answers once the KV is handed off) and to D (as the client asked)
     at the same time.
  3. Return D's answer: streamed through chunk by chunk, or the whole body.
  4. If P fails (error status or connection error), D's request is dropped (its connection closed, so D
     aborts the room) and the client gets P's error. If D refuses (e.g. a config mismatch, HTTP 400), P's
     request is dropped and the client gets D's error.
"""
from __future__ import annotations

import asyncio
import json
import random
from contextlib import asynccontextmanager
from urllib.parse import urlparse

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from specpd.disagg.bootstrap import DEFAULT_BOOTSTRAP_PORT


def _error(message: str, code: int) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": "server_error", "param": None, "code": code}},
                        status_code=code)


def create_router_app(prefill_url: str, decode_url: str, bootstrap_port: int = DEFAULT_BOOTSTRAP_PORT,
                      bootstrap_host: str | None = None) -> FastAPI:
    prefill_url, decode_url = prefill_url.rstrip("/"), decode_url.rstrip("/")
    bootstrap_host = bootstrap_host or urlparse(prefill_url).hostname
    state: dict = {}

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        state["client"] = httpx.AsyncClient(timeout=httpx.Timeout(None, connect=10.0))
        try:
            yield
        finally:
            await state["client"].aclose()

    app = FastAPI(title="specpd router", lifespan=lifespan)

    async def generate(raw: Request, path: str):
        try:
            body = json.loads(await raw.body())
        except json.JSONDecodeError as e:
            return _error(f"body is not JSON: {e}", 400)
        if not isinstance(body, dict):
            return _error("body must be a JSON object", 400)
        body.update(bootstrap_host=bootstrap_host, bootstrap_port=bootstrap_port,
                    bootstrap_room=random.getrandbits(63))
        client: httpx.AsyncClient = state["client"]
        prefill = asyncio.ensure_future(client.post(prefill_url + path, json={**body, "stream": False}))

        async def prefill_failure() -> str | None:
            try:
                resp = await prefill
            except httpx.HTTPError as e:
                return f"prefill server unreachable: {e!r}"
            if resp.status_code != 200:
                return f"prefill server answered {resp.status_code}: {resp.text}"
            return None

        watcher = asyncio.ensure_future(prefill_failure())
        # D's headers come only with its whole body when stream=false: race them against P's failure
        decode = asyncio.ensure_future(
            client.send(client.build_request("POST", decode_url + path, json=body), stream=True))
        done, _ = await asyncio.wait({decode, watcher}, return_when=asyncio.FIRST_COMPLETED)
        if decode not in done and watcher.result() is not None:
            decode.cancel()  # closes the connection: D aborts the room
            return _error(watcher.result(), 502)
        try:
            decode_resp = await decode
        except httpx.HTTPError as e:
            watcher.cancel()
            prefill.cancel()
            return _error(f"decode server unreachable: {e!r}", 502)
        if decode_resp.status_code != 200:
            content = await decode_resp.aread()
            await decode_resp.aclose()
            watcher.cancel()
            prefill.cancel()  # closes the connection: P drops the room from its bootstrap queue
            return Response(content, status_code=decode_resp.status_code,
                            media_type=decode_resp.headers.get("content-type"))
        if not body.get("stream"):
            reader = asyncio.ensure_future(decode_resp.aread())
            done, _ = await asyncio.wait({reader, watcher}, return_when=asyncio.FIRST_COMPLETED)
            if watcher in done and watcher.result() is not None:
                reader.cancel()
                await decode_resp.aclose()
                return _error(watcher.result(), 502)
            content = await reader
            await decode_resp.aclose()
            return Response(content, status_code=200, media_type=decode_resp.headers.get("content-type"))

        async def relay():
            chunks = decode_resp.aiter_raw().__aiter__()
            try:
                while True:
                    nxt = asyncio.ensure_future(chunks.__anext__())
                    waits = {nxt} if watcher.done() else {nxt, watcher}
                    done, _ = await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
                    if nxt not in done:  # P finished first
                        failure = watcher.result()
                        if failure is None:
                            await asyncio.wait({nxt})
                        else:
                            nxt.cancel()
                            yield ("data: " + json.dumps({"error": {"message": failure, "code": 502}}) + "\n\n"
                                   "data: [DONE]\n\n").encode()
                            return
                    try:
                        yield nxt.result()
                    except StopAsyncIteration:
                        return
            finally:
                watcher.cancel()
                await decode_resp.aclose()

        return StreamingResponse(relay(), media_type="text/event-stream")

    @app.post("/v1/completions")
    async def completions(raw: Request):
        return await generate(raw, "/v1/completions")

    @app.post("/v1/chat/completions")
    async def chat_completions(raw: Request):
        return await generate(raw, "/v1/chat/completions")

    @app.get("/v1/models")
    async def models():
        resp = await state["client"].get(decode_url + "/v1/models")
        return Response(resp.content, status_code=resp.status_code, media_type="application/json")

    @app.get("/health")
    async def health():
        client: httpx.AsyncClient = state["client"]
        try:
            p, d = await asyncio.gather(client.get(prefill_url + "/health"), client.get(decode_url + "/health"))
        except httpx.HTTPError as e:
            return _error(f"a backend is unreachable: {e!r}", 503)
        if p.status_code != 200 or d.status_code != 200:
            return _error(f"prefill health {p.status_code}, decode health {d.status_code}", 503)
        return {"status": "ok"}

    @app.get("/server_info")
    async def server_info():
        return {"role": "router", "prefill": prefill_url, "decode": decode_url, "bootstrap_port": bootstrap_port}

    return app
