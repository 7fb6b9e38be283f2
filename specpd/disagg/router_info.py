"""The PD router's endpoints that do not route a request (no torch): /v1/models, /health, /flush_cache, /metrics,
/server_info (also /get_server_info).

/health answers 200 only when a request can go through: the launcher declared the cluster ready (with
--cluster-ready-file), no backend is down by the router's own account (backends.py), and every P and D answers
its /health (its engine alive) and every P's bootstrap server answers (D finds P there).
/metrics: the router's stages of the TTFT breakdown (specpd/disagg/timeline.py) and, per decode server (`decode`
label), what its adaptive policy did: the depth-0 share of its request-rounds beside tau, and the cost model it
calibrated (`decode_spec_metrics`).
/server_info: `prefill` and `decode` list one object per server, its URL plus its own /server_info, so SGLang's
bench_serving finds `decode[0]["internal_states"][0]["avg_spec_accept_length"]`; `decode_spec` lists each decode
server's depth-0 share, tau and cost model side by side (`decode_spec_summary`).
"""
from __future__ import annotations

import asyncio
import os

import httpx
from fastapi import FastAPI
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

from specpd.disagg.backends import Backends
from specpd.disagg.spec_report import decode_spec_metrics, decode_spec_summary
from specpd.disagg.timeline import StageStats


def server_error(message: str, code: int, headers: dict | None = None) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": "server_error", "param": None, "code": code}},
                        status_code=code, headers=headers)


def add_info_routes(app: FastAPI, backends: Backends, stages: StageStats, registry: CollectorRegistry,
                    bootstrap_port: int, cluster_ready_file: str | None) -> None:
    prefill_urls, decode_urls = list(backends.prefill), list(backends.decode)
    ready = {"cluster": False}

    async def ask_backends(path: str, timeout: float) -> list[tuple[str, httpx.Response | Exception]]:
        """GET `path` on every P and D at once: [(url, response or the exception)], P first."""
        urls = prefill_urls + decode_urls
        results = await asyncio.gather(*(backends.client.get(u + path, timeout=timeout) for u in urls),
                                       return_exceptions=True)
        return list(zip(urls, results))

    @app.get("/v1/models")
    async def models():
        resp = await backends.client.get(decode_urls[0] + "/v1/models")
        return Response(resp.content, status_code=resp.status_code, media_type="application/json")

    @app.api_route("/flush_cache", methods=["GET", "POST"])
    async def flush_cache():
        """SGLang's /flush_cache, fanned out to every P and D: each drops its unreferenced cached pages."""
        urls = prefill_urls + decode_urls
        answers = await asyncio.gather(*(backends.client.post(u + "/flush_cache", timeout=30.0) for u in urls),
                                       return_exceptions=True)
        out, bad = {}, []
        for u, r in zip(urls, answers):
            if isinstance(r, Exception) or r.status_code != 200:
                bad.append(f"{u}: {r!r}" if isinstance(r, Exception) else f"{u}: {r.status_code}")
            else:
                out[u] = r.json()
        if bad:
            return server_error("flush_cache failed on: " + "; ".join(bad), 502)
        return {"flushed_pages": sum(v.get("flushed_pages") or 0 for v in out.values()), "servers": out}

    @app.get("/metrics")
    async def metrics():
        answers = await asyncio.gather(*(backends.client.get(u + "/server_info", timeout=5.0) for u in decode_urls),
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
        if cluster_ready_file is not None and not ready["cluster"]:
            if not os.path.exists(cluster_ready_file):
                return server_error("cluster starting: the launcher has not declared it ready yet", 503)
            ready["cluster"] = True
        down = [f"{b.name} is down ({b.why})" for b in backends.all.values() if not b.up]
        if down:
            return server_error("; ".join(down), 503)
        answers = await ask_backends("/health", 10.0)
        boots = [await backends.bootstrap_address(u) for u in prefill_urls]
        answers += zip([f"bootstrap server {h}:{p}" for h, p in boots], await asyncio.gather(
            *(backends.client.get(f"http://{h}:{p}/health", timeout=10.0) for h, p in boots), return_exceptions=True))
        bad = [f"{u}: {r!r}" if isinstance(r, Exception) else f"{u}: health {r.status_code}"
               for u, r in answers if isinstance(r, Exception) or r.status_code != 200]
        if bad:
            return server_error("backend(s) not healthy: " + "; ".join(bad), 503)
        return {"status": "ok"}

    @app.get("/server_info")
    @app.get("/get_server_info")
    async def server_info():
        """The router's own facts, each backend's /server_info (pages, acceptance) under its URL, and sums.
        tau over all D: committed tokens / verify forwards, each D weighted by its verify count."""
        infos = {}
        for url, resp in await ask_backends("/server_info", 5.0):
            try:
                info = resp.json()
                if not isinstance(info, dict):
                    raise ValueError(f"not a JSON object: {info!r}")
            except (AttributeError, ValueError) as e:
                infos[url] = {"url": url, "error": repr(resp if isinstance(resp, Exception) else e)}
                continue
            infos[url] = {"url": url, **info}
        decode = [infos[u] for u in decode_urls if "error" not in infos[u]]
        verify = sum(b.get("spec_verify_count") or 0 for b in decode)
        committed = sum((b.get("spec_accept_length") or 0) * (b.get("spec_verify_count") or 0) for b in decode)
        tau = committed / verify if verify else None
        live = [b for b in infos.values() if "error" not in b]
        return {"role": "router", "pid": os.getpid(), "pd_stages": stages.summary(),
                "prefill": [infos[u] for u in prefill_urls], "decode": [infos[u] for u in decode_urls],
                "bootstrap_port": bootstrap_port, "config": {"prefill": prefill_urls, "decode": decode_urls},
                "down": {b.url: b.why for b in backends.all.values() if not b.up},
                "free_pages": sum(b.get("free_pages") or 0 for b in live),
                "total_pages": sum(b.get("total_pages") or 0 for b in live),
                "spec_verify_count": verify, "spec_accept_length": tau,
                "internal_states": [{"avg_spec_accept_length": tau, "spec_verify_count": verify}],
                "decode_spec": [decode_spec_summary(b["url"], b) for b in decode],
                "backends": {u: {k: b.get(k) for k in ("role", "pid", "free_pages", "total_pages", "config",
                                                       "spec_verify_count", "spec_accepted_tokens",
                                                       "spec_accept_length", "spec_rounds_off_share", "error")
                                 if k in b}
                             for u, b in infos.items()}}
