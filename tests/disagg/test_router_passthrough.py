"""The real router process (`specpd serve --role router`) in front of scripted P and D stand-ins on 127.0.0.1.

A stand-in answers as the test scripts it (status, body, headers, delay), so each refusal path is exact:
P's and D's 400 / 413 / 503 reach the client with their status, body and Retry-After; the router's own
--max-request-bytes and --api-key act before any backend is called (/flush_cache needs the key too), and the
router sends the key on to P and D, which take it as well;
/server_info lists each backend as an object, as SGLang's bench_serving reads it.
"""
import contextlib
import json
import threading
import time

import httpx
import pytest
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from specpd.server.launch import free_port
from tests.server.launcher import launch_servers

KEY = "router-key"


class StandIn:
    """One fake P or D: `script` says how POST /v1/completions answers (status, body, headers, delay; `times`:
    that many requests, then 200 again); `calls` records each request."""

    def __init__(self, role: str, tau: float | None = None):
        self.role, self.tau = role, tau
        self.script: dict = {"status": 200, "delay": 0.0}
        self.calls: list[dict] = []
        self.app = FastAPI()
        self.app.get("/health")(lambda: {"status": "ok"})
        self.app.get("/server_info")(self.server_info)
        self.app.post("/v1/completions")(self.completions)
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"

    def server_info(self):
        # its own port as P's bootstrap server: the router's /health asks that server's /health too
        info = {"role": self.role, "pid": 1, "free_pages": 8, "total_pages": 8, "bootstrap_port": self.port,
                "spec_verify_count": 10 if self.tau else 0, "spec_accept_length": self.tau,
                "internal_states": [{"avg_spec_accept_length": self.tau}]}
        if self.tau:  # a decode server's adaptive policy (LLMEngine._policy_stats)
            info.update(spec_rounds=40, spec_rounds_off=30, spec_rounds_off_share=0.75, spec_probes=3,
                        spec_policy={"accept": [0.4, 0.5], "cost_model": {
                            "clock": "thread_cpu", "target_rows": {"1": 0.047, "2": 0.047, "8": 0.052, "64": 0.2},
                            "draft_rows": {"1": 0.003, "64": 0.02}, "per_request": 0.001, "tree_factor": 1.0,
                            "scale": 1.1, "draft_scale": 1.2}})
        return info

    async def completions(self, raw: Request):
        body = await raw.json()
        self.calls.append({"body": body, "authorization": raw.headers.get("authorization")})
        script = self.script
        if script.get("times") is not None:  # this answer `times` times, then the happy path again
            script["times"] -= 1
            if script["times"] <= 0:
                self.script = {"status": 200, "delay": 0.0}
        if script["delay"]:
            await _sleep(script["delay"])
        if script["status"] != 200:
            return JSONResponse(script["body"], status_code=script["status"], headers=script.get("headers"))
        if body.get("stream"):
            async def chunks():
                yield 'data: {"choices": [{"text": "hi"}]}\n\n'
                if script.get("die_mid_stream"):  # the connection drops without the last chunk
                    raise RuntimeError("decode server died")
                yield "data: [DONE]\n\n"
            return StreamingResponse(chunks(), media_type="text/event-stream")
        return {"choices": [{"text": "hi", "finish_reason": "length"}], "role": self.role}


async def _sleep(seconds: float):
    import asyncio
    await asyncio.sleep(seconds)


@contextlib.contextmanager
def serving(*stand_ins: StandIn):
    servers = [uvicorn.Server(uvicorn.Config(s.app, host="127.0.0.1", port=s.port, log_level="warning"))
               for s in stand_ins]
    threads = [threading.Thread(target=srv.run, daemon=True) for srv in servers]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 20
    while not all(srv.started for srv in servers):
        assert time.monotonic() < deadline, "stand-in servers did not start"
        time.sleep(0.05)
    try:
        yield
    finally:
        for srv in servers:
            srv.should_exit = True
        for t in threads:
            t.join(10)


@pytest.fixture(scope="module")
def cluster():
    p, d = StandIn("prefill"), StandIn("decode", tau=2.5)
    with serving(p, d):
        with launch_servers([["--role", "router", "--prefill", p.url, "--decode", d.url, "--log-level", "warning",
                              "--max-request-bytes", "4096", "--api-key", KEY]]) as [(_, router, _)]:
            yield p, d, router


@pytest.fixture
def backends(cluster):
    p, d, router = cluster
    p.calls.clear(), d.calls.clear()
    yield p, d, httpx.Client(base_url=router, headers={"Authorization": f"Bearer {KEY}"}, timeout=30)
    p.script = d.script = {"status": 200, "delay": 0.0}


BODY = {"prompt": [1, 2, 3], "max_tokens": 4}


def test_the_happy_path_and_the_key_goes_on_to_p_and_d(backends):
    p, d, client = backends
    resp = client.post("/v1/completions", json=BODY)
    assert resp.status_code == 200 and resp.json()["role"] == "decode", resp.text
    deadline = time.monotonic() + 5
    while not p.calls and time.monotonic() < deadline:
        time.sleep(0.02)
    assert [c["authorization"] for c in p.calls + d.calls] == [f"Bearer {KEY}"] * 2  # P and D take it too
    assert p.calls[0]["body"]["bootstrap_room"] == d.calls[0]["body"]["bootstrap_room"]


@pytest.mark.parametrize("status,headers", [(503, {"Retry-After": "7"}), (413, None), (400, None)])
def test_a_prefill_refusal_passes_through(backends, status, headers):
    p, d, client = backends
    error = {"error": {"message": f"P says {status}", "type": "x", "param": None, "code": status}}
    p.script = {"status": status, "body": error, "headers": headers, "delay": 0.0}
    d.script = {"status": 200, "delay": 5.0}  # D waits for P's KV, as a real one would
    start = time.perf_counter()
    resp = client.post("/v1/completions", json=BODY)
    assert time.perf_counter() - start < 2.0  # not after D's wait
    assert resp.status_code == status and resp.json() == error, resp.text
    assert resp.headers.get("Retry-After") == (headers or {}).get("Retry-After")


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("status,headers", [(503, {"Retry-After": "3"}), (413, None)])
def test_a_decode_refusal_passes_through(backends, status, headers, stream):
    p, d, client = backends
    error = {"error": {"message": f"D says {status}", "type": "x", "param": None, "code": status}}
    d.script = {"status": status, "body": error, "headers": headers, "delay": 0.0}
    p.script = {"status": 200, "delay": 5.0}
    resp = client.post("/v1/completions", json={**BODY, "stream": stream})
    assert resp.status_code == status and resp.json() == error, resp.text
    assert resp.headers.get("Retry-After") == (headers or {}).get("Retry-After")


def test_router_enforces_its_own_body_limit_before_any_backend(backends):
    p, d, client = backends
    big = {"prompt": [1] * 3000, "max_tokens": 4}  # ~9 kB > --max-request-bytes 4096
    resp = client.post("/v1/completions", json=big)
    assert resp.status_code == 413 and resp.json()["error"]["code"] == 413, resp.text

    def chunked():
        yield b'{"prompt": ['
        for _ in range(100):
            yield b"1, " * 100
        yield b"1]}"
    resp = client.post("/v1/completions", content=chunked(), headers={"Content-Type": "application/json"})
    assert resp.status_code == 413, resp.text
    # neither body reached a backend (a previous test's call to P, scripted to take 5 s, may land late: its
    # prompt is BODY's)
    assert all(len(c["body"]["prompt"]) <= len(BODY["prompt"]) for c in p.calls + d.calls), p.calls + d.calls


def test_router_requires_the_key(backends, cluster):
    p, d, client = backends
    router = cluster[2]
    mine = {"prompt": [9, 9, 9, 9, 9], "max_tokens": 4}  # told apart from a previous test's late call
    for headers in ({}, {"Authorization": "Bearer nope"}):
        resp = httpx.post(router + "/v1/completions", json=mine, headers=headers)
        assert resp.status_code == 401, resp.text
        assert set(resp.json()["error"]) >= {"message", "type", "code"}
    assert httpx.get(router + "/v1/models").status_code == 401
    for method in ("GET", "POST"):  # an admin route that changes state: the key too
        assert httpx.request(method, router + "/flush_cache").status_code == 401
    assert httpx.get(router + "/health").status_code == 200
    assert not [c for c in p.calls + d.calls if c["body"]["prompt"] == mine["prompt"]], p.calls + d.calls


def test_server_info_lists_backend_objects_as_sglang_reads_them(cluster):
    p, d, router = cluster
    for path in ("/server_info", "/get_server_info"):
        info = httpx.get(router + path).json()
        assert [b["url"] for b in info["prefill"]] == [p.url] and [b["url"] for b in info["decode"]] == [d.url]
        assert info["decode"][0]["role"] == "decode" and info["prefill"][0]["role"] == "prefill"
        assert info["config"] == {"prefill": [p.url], "decode": [d.url]}
        assert info["internal_states"] == [{"avg_spec_accept_length": 2.5, "spec_verify_count": 10}]
    from tests.server.test_server_info import sglang_accept_length
    assert sglang_accept_length(router) == 2.5
    assert json.dumps(info)  # plain JSON all the way down


def test_each_decode_servers_depth0_share_tau_and_cost_model_are_shown(cluster):
    """/server_info's decode_spec and /metrics put every decode server's depth-0 share beside its tau and the
    cost model it calibrated (a D that never or always speculates shows it, and its table shows why)."""
    p, d, router = cluster
    [summary] = httpx.get(router + "/server_info").json()["decode_spec"]
    assert summary["url"] == d.url and summary["spec_rounds_off_share"] == 0.75 and summary["spec_accept_length"] == 2.5
    assert summary["cost_model"]["clock"] == "thread_cpu"
    assert summary["cost_model"]["target_rows"] == {"1": 0.047, "2": 0.047, "8": 0.052}  # 1..16 rows
    text = httpx.get(router + "/metrics").text
    label = f'decode="{d.url}"'
    for line in (f"specpd:decode_spec_rounds_off_share{{{label}}} 0.75", f"specpd:decode_spec_accept_length{{{label}}} 2.5",
                 f'specpd:decode_spec_cost_target_seconds{{{label},rows="8"}} 0.052',
                 f"specpd:decode_spec_cost_scale{{{label}}} 1.1", f"specpd:decode_spec_probes{{{label}}} 3.0"):
        assert line in text, text


def test_an_open_host_without_a_key_is_warned_about(cluster):
    p, d, _ = cluster
    with launch_servers([["--role", "router", "--prefill", p.url, "--decode", d.url, "--host", "0.0.0.0"]]) as [
            (_, router, log)]:
        assert httpx.post(router + "/v1/completions", json=BODY).status_code == 200  # open, as warned
        with open(log) as f:
            text = f.read()
    assert "binds 0.0.0.0 with no API key" in text, text[-2000:]


def test_a_decode_server_dying_mid_stream_ends_the_stream_with_an_error(backends):
    p, d, client = backends
    d.script = {"status": 200, "delay": 0.0, "die_mid_stream": True}
    with client.stream("POST", "/v1/completions", json={**BODY, "stream": True}) as resp:
        assert resp.status_code == 200
        events = [line for line in resp.iter_lines() if line.startswith("data: ")]
    assert events[0] == 'data: {"choices": [{"text": "hi"}]}'
    assert "decode server failed mid-stream" in events[1] and events[-1] == "data: [DONE]", events
