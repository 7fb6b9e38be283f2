"""The PD router: one OpenAI endpoint in front of a prefill server (P) and a decode server (D). No torch.

A request's life in the router:
  0. Admission (specpd/admission.py): --api-key on /v1/* (401), --max-request-bytes (413), before the
     body is parsed. P and D are not asked for a key: they listen on loopback behind this router.
  1. Pick a prefill and a decode server (`--prefill URL[,URL...] --decode URL[,URL...]`) by prefix affinity
     (specpd/disagg/affinity.py: the same leading text goes to the same P and D, the least-loaded one when
     that server is full), draw a
     random 63-bit `bootstrap_room`; add `bootstrap_host`, `bootstrap_port` (P's bootstrap server, read once
     from P's /server_info; --bootstrap-port when P does not say) and the room to the JSON body.
  2. Send it to P (as stream=false: P answers once the KV is handed off) and to D (as the client asked)
     at the same time.
  3. Return D's answer: streamed through chunk by chunk, or the whole body.
  4. If P fails (error status or connection error), D's request is dropped (its connection closed, so D
     aborts the room) and the client gets P's error. If D refuses (e.g. a config mismatch, HTTP 400), P's
     request is dropped and the client gets D's error. A refusal keeps its status, body and Retry-After
     (400 / 413 / 503 reach the client as P or D sent them); only an unreachable server becomes 502.
/metrics: the router's stages of the TTFT breakdown (specpd/disagg/timeline.py); `pd_stages` in /server_info; and
per decode server (`decode` label) what its adaptive policy did: the depth-0 share of its request-rounds beside
tau, and the cost model it calibrated (`decode_spec_metrics`).
/server_info (also /get_server_info): `prefill` and `decode` list one object per server, its URL plus its
own /server_info, so SGLang's bench_serving finds `decode[0]["internal_states"][0]["avg_spec_accept_length"]`;
`decode_spec` lists each decode server's depth-0 share, tau and cost model side by side (`decode_spec_summary`).
"""
from __future__ import annotations

import asyncio
import json
import os
import random
import time
from contextlib import asynccontextmanager
from urllib.parse import urlparse

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

from specpd.disagg.affinity import AffinityPicker, prefix_key
from specpd.disagg.spec_report import decode_spec_metrics, decode_spec_summary
from specpd.disagg.bootstrap import DEFAULT_BOOTSTRAP_PORT
from specpd.disagg.timeline import StageCollector, StageStats
from specpd.admission import DEFAULT_MAX_REQUEST_BYTES, Admission

_PASSED_HEADERS = ("retry-after",)  # a backend's refusal reaches the client with these
_WILDCARDS = ("0.0.0.0", "::", "")  # bind-everything addresses: not where a peer can reach a server


def _drop(task: asyncio.Future) -> None:
    """Cancel a task nobody awaits any more and take whatever it ends with: a stream read that the
    cancellation (or the connection closed under it) ends in an httpx error would otherwise be logged
    as "Task exception was never retrieved" when the task is collected."""
    task.cancel()
    task.add_done_callback(lambda t: t.cancelled() or t.exception())


def _drop_if(task: asyncio.Future | None) -> None:
    if task is not None:
        _drop(task)


async def _client_gone(raw: Request) -> None:
    """Returns when the client closes its connection (call once the body has been read)."""
    while (await raw.receive())["type"] != "http.disconnect":
        pass


def _error(message: str, code: int) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": "server_error", "param": None, "code": code}},
                        status_code=code)


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


def create_router_app(prefill_url: str | list[str], decode_url: str | list[str],
                      bootstrap_port: int = DEFAULT_BOOTSTRAP_PORT, bootstrap_host: str | None = None,
                      max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES, api_key: str | None = None,
                      cluster_ready_file: str | None = None) -> FastAPI:
    """cluster_ready_file: /health answers 503 until this file exists (`specpd serve --disagg` creates it once it
    has printed its ready line and supervises the cluster: no client sees a 200 before that)."""
    prefill_urls, decode_urls = _urls(prefill_url), _urls(decode_url)
    pickers = (AffinityPicker(prefill_urls), AffinityPicker(decode_urls))
    state: dict = {"bootstrap": {}}  # P url -> (bootstrap host, port)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        state["client"] = httpx.AsyncClient(timeout=httpx.Timeout(None, connect=10.0))
        await asyncio.gather(*(bootstrap_address(u) for u in prefill_urls))  # learn them while P is fresh
        try:
            yield
        finally:
            await state["client"].aclose()

    app = FastAPI(title="specpd router", lifespan=lifespan)
    stages = StageStats()  # router_* stages of the TTFT breakdown (timeline.py), on the router's clock
    registry = CollectorRegistry()
    registry.register(StageCollector(stages, "router"))
    app.add_middleware(Admission, max_request_bytes=max_request_bytes, api_key=api_key)

    async def bootstrap_address(url: str) -> tuple[str, int]:
        known = state["bootstrap"].get(url)
        if known is None:
            port = bootstrap_port
            try:
                resp = await state["client"].get(url + "/server_info", timeout=10.0)
                port = int(resp.json().get("bootstrap_port") or port)
                told = resp.json().get("bootstrap_host")  # P's --advertise-host: where D reaches it
                if bootstrap_host is None and told and told not in _WILDCARDS:
                    state["bootstrap"][url] = (told, port)
                    return told, port
            except (httpx.HTTPError, ValueError, AttributeError):
                pass  # P unreachable now: its POST fails below with a clear error; ask again next time
            else:
                state["bootstrap"][url] = (bootstrap_host or urlparse(url).hostname, port)
            return bootstrap_host or urlparse(url).hostname, port
        return known

    async def generate(raw: Request, path: str):
        """Route one request; the servers' in-flight counts drop when its answer (or stream) ends."""
        routed: dict = {}
        try:
            resp = await route(raw, path, routed)
        except BaseException:
            routed.pop("release", lambda: None)()
            raise
        if not isinstance(resp, StreamingResponse):
            routed.pop("release", lambda: None)()
        return resp

    async def route(raw: Request, path: str, routed: dict):
        received = time.monotonic()
        try:
            body = await asyncio.to_thread(json.loads, await raw.body())  # bounded by the middleware
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            return _error(f"body is not JSON: {e}", 400)
        if not isinstance(body, dict):
            return _error("body must be a JSON object", 400)
        key = prefix_key(body)  # the same leading text -> the same P and D (their prefix caches hit)
        prefill_url, decode_url = pickers[0].pick(key), pickers[1].pick(key)
        pickers[0].acquire(prefill_url)
        pickers[1].acquire(decode_url)

        def release() -> None:
            pickers[0].release(prefill_url)
            pickers[1].release(decode_url)

        routed["release"] = release
        host, port = await bootstrap_address(prefill_url)
        body.update(bootstrap_host=host, bootstrap_port=port, bootstrap_room=random.getrandbits(63))
        client: httpx.AsyncClient = state["client"]
        p_body = {k: v for k, v in body.items() if k != "stream_options"}  # only valid with stream=true
        prefill = asyncio.ensure_future(client.post(prefill_url + path, json={**p_body, "stream": False}))

        def prefill_answered(f: asyncio.Future) -> None:
            if not f.cancelled() and f.exception() is None and f.result().status_code == 200:
                stages.observe({"router_prefill_done": time.monotonic() - received})

        prefill.add_done_callback(prefill_answered)

        async def prefill_failure() -> Response | None:
            """None once P handed the KV off; else what the client gets (P's refusal as P sent it)."""
            try:
                resp = await prefill
            except httpx.HTTPError as e:
                return _error(f"prefill server unreachable: {e!r}", 502)
            if resp.status_code != 200:
                return _relayed(resp, resp.content)
            return None

        watcher = asyncio.ensure_future(prefill_failure())
        # D's headers come only with its whole body when stream=false: race them against P's failure and,
        # with no stream whose cancellation would tell us, against the client hanging up
        decode = asyncio.ensure_future(
            client.send(client.build_request("POST", decode_url + path, json=body), stream=True))
        gone = None if body.get("stream") else asyncio.ensure_future(_client_gone(raw))
        waits = {decode, watcher, gone} - {None}
        while decode in waits:
            done, _ = await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
            if gone in done:
                for task in (decode, watcher, prefill):  # closing the connections aborts the room on D and P
                    _drop(task)
                return Response(status_code=499)  # nobody reads it (nginx's "client closed request")
            if watcher in done and watcher.result() is not None:
                _drop(decode)  # closes the connection: D aborts the room
                _drop_if(gone)
                return watcher.result()
            waits -= done
        try:
            decode_resp = await decode
        except httpx.HTTPError as e:
            _drop(watcher)
            _drop(prefill)
            _drop_if(gone)
            return _error(f"decode server unreachable: {e!r}", 502)
        if decode_resp.status_code == 200:
            stages.observe({"router_decode_headers": time.monotonic() - received})
        if decode_resp.status_code != 200:
            content = await decode_resp.aread()
            await decode_resp.aclose()
            _drop(watcher)
            _drop(prefill)  # closes the connection: P drops the room from its bootstrap queue
            _drop_if(gone)
            return _relayed(decode_resp, content)
        if not body.get("stream"):
            reader = asyncio.ensure_future(decode_resp.aread())
            try:
                done, _ = await asyncio.wait({reader, watcher, gone}, return_when=asyncio.FIRST_COMPLETED)
                if gone in done:
                    return Response(status_code=499)
                if watcher in done and watcher.result() is not None:
                    return watcher.result()
                content = await reader
            except httpx.HTTPError as e:  # D died while answering
                return _error(f"decode server failed: {e!r}", 502)
            finally:  # closing D's connection before its answer is read aborts the request there
                for task in (reader, watcher, gone):
                    _drop(task)
                await decode_resp.aclose()
            return Response(content, status_code=200, media_type=decode_resp.headers.get("content-type"))

        async def relay():
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
                            message = f"prefill failed ({failure.status_code}): {failure.body.decode(errors='replace')}"
                            yield ("data: " + json.dumps({"error": {"message": message, "code": failure.status_code}})
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
                if nxt is not None:  # the client left mid-stream: no orphaned read, its outcome taken
                    _drop(nxt)
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
        resp = await state["client"].get(decode_urls[0] + "/v1/models")
        return Response(resp.content, status_code=resp.status_code, media_type="application/json")

    async def ask_backends(path: str, timeout: float) -> list[tuple[str, httpx.Response | Exception]]:
        """GET `path` on every P and D at once: [(url, response or the exception)], P first."""
        urls = prefill_urls + decode_urls
        results = await asyncio.gather(*(state["client"].get(u + path, timeout=timeout) for u in urls),
                                       return_exceptions=True)
        return list(zip(urls, results))

    @app.api_route("/flush_cache", methods=["GET", "POST"])
    async def flush_cache():
        """SGLang's /flush_cache, fanned out to every P and D: each drops its unreferenced cached pages."""
        urls = prefill_urls + decode_urls
        answers = await asyncio.gather(*(state["client"].post(u + "/flush_cache", timeout=30.0) for u in urls),
                                       return_exceptions=True)
        out, bad = {}, []
        for u, r in zip(urls, answers):
            if isinstance(r, Exception) or r.status_code != 200:
                bad.append(f"{u}: {r!r}" if isinstance(r, Exception) else f"{u}: {r.status_code}")
            else:
                out[u] = r.json()
        if bad:
            return _error("flush_cache failed on: " + "; ".join(bad), 502)
        return {"flushed_pages": sum(v.get("flushed_pages") or 0 for v in out.values()), "servers": out}

    @app.get("/metrics")
    async def metrics():
        answers = await asyncio.gather(*(state["client"].get(u + "/server_info", timeout=5.0) for u in decode_urls),
                                       return_exceptions=True)
        summaries = []
        for url, resp in zip(decode_urls, answers):
            try:
                summaries.append(decode_spec_summary(url, resp.json()))
            except (AttributeError, ValueError):  # a decode server down or not answering: no series for it
                continue
        return Response(generate_latest(registry) + decode_spec_metrics(summaries), media_type=CONTENT_TYPE_LATEST)

    @app.get("/health")
    async def health():
        if cluster_ready_file is not None and not state.get("cluster_ready"):
            if not os.path.exists(cluster_ready_file):
                return _error("cluster starting: the launcher has not declared it ready yet", 503)
            state["cluster_ready"] = True
        answers = await ask_backends("/health", 10.0)
        bad = [f"{u}: {r!r}" if isinstance(r, Exception) else f"{u}: health {r.status_code}"
               for u, r in answers if isinstance(r, Exception) or r.status_code != 200]
        if bad:
            return _error("backend(s) not healthy: " + "; ".join(bad), 503)
        return {"status": "ok"}

    @app.get("/server_info")
    @app.get("/get_server_info")
    async def server_info():
        """The router's own facts, each backend's /server_info (pages, acceptance) under its URL, and sums.
        tau over all D: committed tokens / verify forwards, each D weighted by its verify count."""
        backends = {}
        for url, resp in await ask_backends("/server_info", 5.0):
            try:
                info = resp.json()
                if not isinstance(info, dict):
                    raise ValueError(f"not a JSON object: {info!r}")
            except (AttributeError, ValueError) as e:
                backends[url] = {"url": url, "error": repr(resp if isinstance(resp, Exception) else e)}
                continue
            backends[url] = {"url": url, **info}
        decode = [backends[u] for u in decode_urls if "error" not in backends[u]]
        verify = sum(b.get("spec_verify_count") or 0 for b in decode)
        committed = sum((b.get("spec_accept_length") or 0) * (b.get("spec_verify_count") or 0) for b in decode)
        tau = committed / verify if verify else None
        live = [b for b in backends.values() if "error" not in b]
        decode_spec = [decode_spec_summary(b["url"], b) for b in decode]
        return {"role": "router", "pid": os.getpid(), "pd_stages": stages.summary(),
                "prefill": [backends[u] for u in prefill_urls], "decode": [backends[u] for u in decode_urls],
                "bootstrap_port": bootstrap_port, "config": {"prefill": prefill_urls, "decode": decode_urls},
                "free_pages": sum(b.get("free_pages") or 0 for b in live),
                "total_pages": sum(b.get("total_pages") or 0 for b in live),
                "spec_verify_count": verify, "spec_accept_length": tau,
                "internal_states": [{"avg_spec_accept_length": tau, "spec_verify_count": verify}],
                "decode_spec": decode_spec,
                "backends": {u: {k: b.get(k) for k in ("role", "pid", "free_pages", "total_pages", "config",
                                                       "spec_verify_count", "spec_accepted_tokens",
                                                       "spec_accept_length", "spec_rounds_off_share", "error")
                                 if k in b}
                             for u, b in backends.items()}}

    return app
