"""The PD router: one OpenAI endpoint in front of a prefill server (P) and a decode server (D). No torch.

A request's life in the router:
  0. Admission (specpd/admission.py): --api-key on every route but /health, /metrics and /server_info (401),
     --max-request-bytes (413), before the body is parsed. The router sends the same key to P and D, which
     take it too (`specpd serve --disagg` gives every child the cluster's key).
  1. Pick a prefill and a decode server (`--prefill URL[,URL...] --decode URL[,URL...]`) by prefix affinity
     (specpd/disagg/affinity.py: the same leading text goes to the same P and D, the least-loaded one when
     that server is full; a server that is down is skipped while another is up), draw a random 63-bit
     `bootstrap_room`; add `bootstrap_host`, `bootstrap_port` (P's bootstrap server, from P's /server_info;
     --bootstrap-port when P does not say) and the room to the JSON body.
  2. If P or D is down (backends.py: a refused or cut connection, a dead engine, until its health probe
     answers again: a restart), wait for it up to --pd-restart-wait (RESTART_WAIT_S) after the request
     arrived; still down: 503 with Retry-After naming it.
  3. Send it to P (as stream=false: P answers once the KV is handed off) and to D (as the client asked)
     at the same time, each on a connection of its own (backends.Exchange).
  4. Return D's answer: streamed through chunk by chunk, or the whole body.
  5. If P fails (error status or connection error), D's request is dropped (its connection closed, so D
     aborts the room) and the client gets P's error. If D refuses (e.g. a config mismatch, HTTP 400), P's
     request is dropped and the client gets D's error. A refusal keeps its status, body and Retry-After
     (400 / 413 / 503 reach the client as P or D sent them). A server that went down under the request
     (its connection refused or cut, its engine dead, D unable to reach P's bootstrap server) before anything
     reached the client has the request sent again, with a new room, from step 2 (at most MAX_ATTEMPTS).
     Once D's stream has begun, a failure ends it with an error event.
A request of n > 1 parallel samples is split into n such requests and their answers merged (router_samples.py).
The other routes (/health, /metrics, /server_info, /flush_cache, /v1/models) are in router_info.py.
"""
from __future__ import annotations

import asyncio
import json
import random
import time
from contextlib import asynccontextmanager

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CollectorRegistry

from specpd.admission import DEFAULT_MAX_REQUEST_BYTES, Admission, error_body
from specpd.disagg.affinity import AffinityPicker, prefix_key
from specpd.disagg.backends import Backends, Exchange
from specpd.disagg.bootstrap import DEFAULT_BOOTSTRAP_PORT
from specpd.disagg.router_info import add_info_routes, server_error
from specpd.disagg.router_samples import MAX_N, child_bodies, merge_bodies, merge_streams, samples
from specpd.disagg.timeline import StageCollector, StageStats

_PASSED_HEADERS = ("retry-after",)  # a backend's refusal reaches the client with these
# a request waits this long (from its arrival) for a P or D that is down (--pd-restart-wait): long enough for
# `specpd serve --disagg` to restart a dead child on a small box (its backoff, then its load); then 503 + Retry-After
RESTART_WAIT_S = 15.0
RETRY_AFTER_S = 5
# D answered an error: how long to wait for P's side of the exchange to say P went down (then it is a retry)
P_FAILURE_GRACE_S = 1.0
MAX_ATTEMPTS = 4  # sends of one request: a server that goes down under it again and again is not waited on forever


class _Retry(Exception):
    """A backend went down under the request before anything reached the client: send it again."""

    def __init__(self, url: str, why: str):
        super().__init__(why)
        self.url, self.why = url, why


def _drop(task: asyncio.Future | None) -> None:
    """Cancel a task nobody awaits any more and take whatever it ends with (else "Task exception was never
    retrieved" is logged when it is collected)."""
    if task is not None:
        task.cancel()
        task.add_done_callback(lambda t: t.cancelled() or t.exception())


async def _client_gone(raw: Request) -> None:
    """Returns when the client closes its connection (call once the body has been read)."""
    while (await raw.receive())["type"] != "http.disconnect":
        pass


def _urls(spec: str | list[str]) -> list[str]:
    items = spec.split(",") if isinstance(spec, str) else list(spec)
    urls = [u.strip().rstrip("/") for u in items if u.strip()]
    if not urls:
        raise ValueError(f"no server URL in {spec!r}")
    return urls


def _relayed(resp: httpx.Response, content: bytes) -> Response:
    """A backend's refusal as the client gets it: same status, body, content type and Retry-After."""
    return Response(content, status_code=resp.status_code, media_type=resp.headers.get("content-type"),
                    headers={k: resp.headers[k] for k in _PASSED_HEADERS if k in resp.headers})


def _went_down(url: str, resp: httpx.Response) -> str | None:
    """Why an answer of `url` means it cannot serve now (then the request is sent again), None if it is the
    answer: 503 without Retry-After is a dead engine (a full queue says when to retry)."""
    if resp.status_code == 503 and "retry-after" not in resp.headers:
        return f"answered 503: {resp.text[:200]}"
    return None


def create_router_app(prefill_url: str | list[str], decode_url: str | list[str],
                      bootstrap_port: int = DEFAULT_BOOTSTRAP_PORT, bootstrap_host: str | None = None,
                      max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES, api_key: str | None = None,
                      cluster_ready_file: str | None = None, restart_wait_s: float = RESTART_WAIT_S) -> FastAPI:
    """cluster_ready_file: /health answers 503 until this file exists (`specpd serve --disagg` creates it once it
    has printed its ready line and supervises the cluster: no client sees a 200 before that)."""
    prefill_urls, decode_urls = _urls(prefill_url), _urls(decode_url)
    pickers = (AffinityPicker(prefill_urls), AffinityPicker(decode_urls))
    backends = Backends(prefill_urls, decode_urls, bootstrap_port, bootstrap_host, api_key)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        await backends.start()  # learn P's bootstrap addresses while P is fresh
        try:
            yield
        finally:
            await backends.close()

    app = FastAPI(title="specpd router", lifespan=lifespan)
    stages = StageStats()  # router_* stages of the TTFT breakdown (timeline.py), on the router's clock
    registry = CollectorRegistry()
    registry.register(StageCollector(stages, "router"))
    app.add_middleware(Admission, max_request_bytes=max_request_bytes, api_key=api_key)
    add_info_routes(app, backends, stages, registry, bootstrap_port, cluster_ready_file)

    def unavailable(down: list, attempts: int = 0) -> Response:
        what = "; ".join(f"{b.name} is down ({b.why})" for b in down)
        tried = f" (sent {attempts} times)" if attempts > 1 else ""
        return server_error(f"{what}{tried}: try again shortly (it is restarting or overloaded)", 503,
                            {"Retry-After": str(RETRY_AFTER_S)})

    async def generate(raw: Request, path: str):
        try:
            body = await asyncio.to_thread(json.loads, await raw.body())  # bounded by the middleware
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            return server_error(f"body is not JSON: {e}", 400)
        if not isinstance(body, dict):
            return server_error("body must be a JSON object", 400)
        if (n := samples(body)) is not None:
            return await fan_out(raw, path, body, n)
        return await one(raw, path, body, {})

    async def one(raw: Request, path: str, body: dict, routed: dict, gone: asyncio.Future | None = None):
        """Route one request; the servers' in-flight counts drop when its answer (or stream) ends."""
        try:
            resp = await route(raw, path, body, routed, gone)
        except BaseException:
            routed.pop("release", lambda: None)()
            raise
        if not isinstance(resp, StreamingResponse):
            routed.pop("release", lambda: None)()
        return resp

    async def fan_out(raw: Request, path: str, body: dict, n: int):
        """n > 1: one request per sample, the first alone until P has prefilled it (router_samples.py)."""
        if n > MAX_N:
            return JSONResponse(error_body(f"n: must be an integer in [1, {MAX_N}], got {n}", "n", 400), 400)
        gone = None if body.get("stream") else asyncio.ensure_future(_client_gone(raw))
        bodies, routed = child_bodies(body, n), [{"prefilled": asyncio.Event()} for _ in range(n)]
        tasks = [asyncio.ensure_future(one(raw, path, bodies[0], routed[0], gone))]
        try:
            prefilled = asyncio.ensure_future(routed[0]["prefilled"].wait())  # set once P answers, however
            await asyncio.wait({tasks[0], prefilled}, return_when=asyncio.FIRST_COMPLETED)
            if tasks[0].done() and not tasks[0].exception() and isinstance(tasks[0].result(), StreamingResponse):
                await prefilled  # D's stream began before P handed the KV off: wait for P's answer
            _drop(prefilled)
            tasks += [asyncio.ensure_future(one(raw, path, b, r, gone)) for b, r in zip(bodies[1:], routed[1:])]
            responses = await asyncio.gather(*tasks)
        except BaseException:
            _close_samples(tasks, routed)
            raise
        finally:
            _drop(gone)
        failed = next((r for r in responses if r.status_code != 200), None)
        if failed is not None:  # the others end: their rooms on P and D with them
            _close_samples(tasks, routed)
            return failed
        if body.get("stream"):
            return StreamingResponse(merge_streams([r.body_iterator for r in responses]),
                                     media_type="text/event-stream")
        return Response(json.dumps(merge_bodies([json.loads(r.body) for r in responses])), status_code=200,
                        media_type="application/json")

    def _close_samples(tasks: list[asyncio.Future], routed: list[dict]) -> None:
        """End a split request's samples that will not be relayed: a task still running is cancelled; a stream
        that began is closed without being read (its `close`, set by `send`)."""
        for task, r in zip(tasks, routed):
            if not task.done():
                _drop(task)
            r.pop("close", lambda: None)()

    async def route(raw: Request, path: str, body: dict, routed: dict, gone: asyncio.Future | None = None):
        received = time.monotonic()
        key = prefix_key(body)  # the same leading text -> the same P and D (their prefix caches hit)
        deadline = received + restart_wait_s
        # the client hanging up (a non-streamed request has no stream whose cancellation would tell us); a
        # request split into samples shares the one watch its caller owns
        owned = gone is None and not body.get("stream")
        gone = asyncio.ensure_future(_client_gone(raw)) if owned else gone
        try:
            for attempt in range(1, MAX_ATTEMPTS + 1):
                routed.pop("release", lambda: None)()
                prefill_url = pickers[0].pick(key, backends.usable(prefill_urls))
                decode_url = pickers[1].pick(key, backends.usable(decode_urls))
                pickers[0].acquire(prefill_url)  # at once: the next request's pick must see this one (no await between)
                pickers[1].acquire(decode_url)
                routed["release"] = lambda p=prefill_url, d=decode_url: (pickers[0].release(p), pickers[1].release(d))
                waiting = asyncio.ensure_future(backends.wait_up([prefill_url, decode_url], deadline))
                await asyncio.wait({waiting} | ({gone} if gone else set()), return_when=asyncio.FIRST_COMPLETED)
                if not waiting.done():
                    _drop(waiting)
                    return Response(status_code=499)  # nobody reads it (nginx's "client closed request")
                if down := waiting.result():
                    return unavailable(down, attempt - 1)
                try:
                    return await send(raw, path, body, prefill_url, decode_url, received, gone, routed)
                except _Retry as e:
                    backends.mark_down(e.url, e.why)
            return unavailable([b for b in backends.all.values() if not b.up] or [backends.all[prefill_url]],
                               MAX_ATTEMPTS)
        finally:
            if owned:
                _drop(gone)

    async def send(raw: Request, path: str, body: dict, prefill_url: str, decode_url: str, received: float,
                   gone: asyncio.Future | None, routed: dict):
        """One sending of the request to P and D (module docstring, steps 3-5); raises _Retry when P or D went
        down under it before anything reached the client."""
        host, port = await backends.bootstrap_address(prefill_url)
        body = {**body, "bootstrap_host": host, "bootstrap_port": port, "bootstrap_room": random.getrandbits(63)}
        p_body = {k: v for k, v in body.items() if k != "stream_options"}  # only valid with stream=true
        p_ex, d_ex = backends.exchange(), backends.exchange()
        prefill = p_ex.post(prefill_url + path, {**p_body, "stream": False})

        def prefill_answered(f: asyncio.Future) -> None:
            if not f.cancelled() and f.exception() is None and f.result().status_code == 200:
                stages.observe({"router_prefill_done": time.monotonic() - received})
            if "prefilled" in routed:  # the first of a request's samples: P's cache has its prompt, or P failed
                routed["prefilled"].set()

        prefill.add_done_callback(prefill_answered)

        async def prefill_failure() -> Response | _Retry | None:
            """None once P handed the KV off; else what the client gets (P's refusal as P sent it), or _Retry."""
            try:
                resp = await prefill
            except httpx.TransportError as e:
                return _Retry(prefill_url, f"unreachable: {e!r}")
            if (why := _went_down(prefill_url, resp)) is not None:
                return _Retry(prefill_url, why)
            return None if resp.status_code == 200 else _relayed(resp, resp.content)

        watcher = asyncio.ensure_future(prefill_failure())
        decode = d_ex.send(decode_url + path, body)
        streaming = False
        try:
            # D's headers come only with its whole body when stream=false: race them against P's failure and
            # against the client hanging up
            waits = {decode, watcher, gone} - {None}
            while decode in waits:
                done, _ = await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
                if gone in done:  # closing the connections aborts the room on D and P
                    return Response(status_code=499)
                if watcher in done and watcher.result() is not None:
                    return _raise_retry(watcher.result())
                waits -= done
            try:
                decode_resp = decode.result()
            except httpx.TransportError as e:
                raise _Retry(decode_url, f"unreachable: {e!r}") from None
            if decode_resp.status_code != 200:
                content = await decode_resp.aread()
                if decode_resp.status_code == 502:  # D could not reach P's bootstrap server: P is down
                    raise _Retry(prefill_url, f"the decode server could not reach it: {content[:200]!r}")
                if (why := _went_down(decode_url, decode_resp)) is not None:
                    raise _Retry(decode_url, why)
                # D failed the room because P went down under it (D's control connection saw it first): P's own
                # cut connection says so within moments, and the request is sent again rather than failed
                await asyncio.wait({watcher}, timeout=P_FAILURE_GRACE_S)
                if watcher.done() and isinstance(watcher.result(), _Retry):
                    raise watcher.result()
                return _relayed(decode_resp, content)
            stages.observe({"router_decode_headers": time.monotonic() - received})
            if not body.get("stream"):
                reader = asyncio.ensure_future(decode_resp.aread())
                try:
                    done, _ = await asyncio.wait({reader, watcher, gone}, return_when=asyncio.FIRST_COMPLETED)
                    if gone in done:
                        return Response(status_code=499)
                    if watcher in done and watcher.result() is not None:
                        return _raise_retry(watcher.result())
                    content = await reader
                except httpx.TransportError as e:  # D died while answering: nothing reached the client yet
                    raise _Retry(decode_url, f"failed while answering: {e!r}") from None
                finally:
                    _drop(reader)
                return Response(content, status_code=200, media_type=decode_resp.headers.get("content-type"))
            streaming = True
            # a stream that is never read (a split request's sample, dropped: fan_out) still ends its exchanges
            routed["close"] = lambda: (_drop(watcher), p_ex.drop(), d_ex.drop(), routed.pop("release", lambda: None)())
            return StreamingResponse(relay(decode_resp, watcher, p_ex, d_ex, received, routed),
                                     media_type="text/event-stream")
        finally:
            if not streaming:  # closing P's connection before its answer drops the room there (D's: the same)
                _drop(watcher)
                p_ex.drop()
                d_ex.drop()

    def _raise_retry(failure: Response | _Retry) -> Response:
        if isinstance(failure, _Retry):
            raise failure
        return failure

    async def relay(decode_resp: httpx.Response, watcher: asyncio.Future, p_ex: Exchange, d_ex: Exchange,
                    received: float, routed: dict):
        chunks = decode_resp.aiter_raw().__aiter__()
        nxt = None
        first = True
        try:
            while True:
                nxt = asyncio.ensure_future(chunks.__anext__())
                waits = {nxt} if watcher.done() else {nxt, watcher}
                done, _ = await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
                if nxt not in done:  # P finished first
                    failure = watcher.result()
                    if failure is None:
                        await asyncio.wait({nxt})
                    else:  # D's stream has begun: the status is sent, the error goes in-band
                        _drop(nxt)
                        if isinstance(failure, _Retry):
                            code, text = 503, f"prefill server {failure.url} went down: {failure.why}"
                        else:
                            code, text = failure.status_code, failure.body.decode(errors="replace")
                        message = f"prefill failed ({code}): {text}"
                        yield ("data: " + json.dumps({"error": {"message": message, "code": code}})
                               + "\n\n" + "data: [DONE]\n\n").encode()
                        return
                try:
                    chunk = nxt.result()
                except StopAsyncIteration:
                    return
                except httpx.HTTPError as e:  # D died mid-stream: the status is sent, the error goes in-band
                    yield ("data: " + json.dumps({"error": {"message": f"decode server failed mid-stream: {e!r}",
                                                            "code": 502}}) + "\n\n" + "data: [DONE]\n\n").encode()
                    return
                if first:  # D streams nothing before its first output (y0): this is the first token
                    first = False
                    stages.observe({"router_ttft": time.monotonic() - received})
                yield chunk
        finally:
            routed.pop("release", lambda: None)()
            _drop(watcher)
            _drop(nxt)  # the client left mid-stream: no orphaned read, its outcome taken
            p_ex.drop()
            d_ex.drop()

    @app.post("/v1/completions")
    async def completions(raw: Request):
        return await generate(raw, "/v1/completions")

    @app.post("/v1/chat/completions")
    async def chat_completions(raw: Request):
        return await generate(raw, "/v1/chat/completions")

    return app
