"""The router while a P or D restarts (router.py steps 2 and 5, backends.py), against scripted P and D stand-ins
(test_router_passthrough.StandIn), the router app in this process with a short wait for a server that is down:

- P down (its port refuses) past the wait: the client gets 503 with Retry-After naming P (never a 502), the
  router's /health is 503 naming it, and D is not asked meanwhile; once P is back on its port the router's
  probe finds it and the next request goes through, /health 200 again.
- D answering 503 without Retry-After (a dead engine) once: the request is sent again with a new room and the
  client gets D's answer.
- Many clients that hang up the moment their request is sent: the router holds no connection to P or D for
  any of them afterwards (its shared pool kept a connection cancelled mid-connect for good, till it ran out
  and every request waited for one forever: the hung cluster of issue 63).
"""
import json
import socket
import threading
import time

import httpx
import pytest
import uvicorn

from specpd.disagg.router import create_router_app
from specpd.server.launch import free_port
from tests.disagg.test_router_passthrough import StandIn

WAIT_S = 1.5  # the router's wait for a server that is down
BODY = {"prompt": [1, 2, 3], "max_tokens": 4}


class Served:
    """An ASGI app on its port in a thread of this process, stopped and started again at will."""

    def __init__(self, app, port: int):
        self.app, self.port, self.server, self.thread = app, port, None, None

    def start(self) -> "Served":
        self.server = uvicorn.Server(uvicorn.Config(self.app, host="127.0.0.1", port=self.port, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 20
        while not self.server.started:
            assert time.monotonic() < deadline and self.thread.is_alive(), f"nothing serves on {self.port}"
            time.sleep(0.02)
        return self

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(10)


def _connections_to(port: int) -> int:
    """Client-side TCP connections to `port` open on this box (established, or closed by the peer and not yet by
    the client), from /proc/net/tcp."""
    count = 0
    with open("/proc/net/tcp") as f:
        for line in f.readlines()[1:]:
            fields = line.split()
            if int(fields[2].split(":")[1], 16) == port and fields[3] in ("01", "08"):
                count += 1
    return count


@pytest.fixture(scope="module")
def cluster():
    p, d = StandIn("prefill"), StandIn("decode")
    served = {"p": Served(p.app, p.port).start(), "d": Served(d.app, d.port).start()}
    port = free_port()
    router = Served(create_router_app(p.url, d.url, restart_wait_s=WAIT_S), port).start()
    try:
        yield p, d, served, f"http://127.0.0.1:{port}"
    finally:
        for s in (router, *served.values()):
            s.stop()


@pytest.fixture
def stand_ins(cluster):
    p, d, served, base = cluster
    p.script = d.script = {"status": 200, "delay": 0.0}
    p.calls.clear(), d.calls.clear()
    return p, d, served, base


def test_a_prefill_server_down_past_the_wait_is_a_503_with_retry_after_then_found_again(stand_ins):
    p, d, served, base = stand_ins
    assert httpx.post(base + "/v1/completions", json=BODY, timeout=30).status_code == 200
    served["p"].stop()
    d_calls = len(d.calls)
    asked = time.monotonic()
    resp = httpx.post(base + "/v1/completions", json=BODY, timeout=30)
    took = time.monotonic() - asked
    print(f"\nwith P down: {resp.status_code} after {took:.2f} s: {resp.text[:200]}")
    try:
        assert resp.status_code == 503 and int(resp.headers["Retry-After"]) >= 1, resp.text
        assert f"prefill server {p.url} is down" in resp.json()["error"]["message"], resp.text
        assert took >= WAIT_S - 0.1  # it waited for P first
        health = httpx.get(base + "/health", timeout=30)
        assert health.status_code == 503 and f"prefill server {p.url} is down" in health.text, health.text
        d_calls = len(d.calls)
        resp = httpx.post(base + "/v1/completions", json=BODY, timeout=30)  # P known down: D is not asked
        assert resp.status_code == 503 and len(d.calls) == d_calls, (resp.text, len(d.calls) - d_calls)
    finally:
        served["p"].start()  # P back on its port
    deadline = time.monotonic() + 20
    while (resp := httpx.post(base + "/v1/completions", json=BODY, timeout=30)).status_code != 200:
        assert resp.status_code == 503, resp.text
        assert time.monotonic() < deadline, "the router never found P again"
    assert httpx.get(base + "/health", timeout=30).status_code == 200


def test_a_dead_decode_engine_is_waited_out_and_the_request_sent_again(stand_ins):
    p, d, served, base = stand_ins
    error = {"error": {"message": "engine thread is not running", "type": "server_error", "param": None,
                       "code": 503}}
    d.script = {"status": 503, "body": error, "delay": 0.0, "times": 1}  # no Retry-After: not a full queue
    resp = httpx.post(base + "/v1/completions", json=BODY, timeout=30)
    assert resp.status_code == 200 and resp.json()["role"] == "decode", resp.text
    rooms = [c["body"]["bootstrap_room"] for c in d.calls]
    assert len(rooms) == 2 and rooms[0] != rooms[1], rooms  # sent again, with a new room
    deadline = time.monotonic() + 5
    while len(p.calls) < 2:  # P's first half was dropped, its second answered
        assert time.monotonic() < deadline, p.calls
        time.sleep(0.02)
    assert [c["body"]["bootstrap_room"] for c in p.calls] == rooms


def test_requests_dropped_mid_connect_leave_no_connection_behind(stand_ins):
    """Clients that hang up the moment their request is sent: the router drops both halves while their
    connections to P and D are still being made (httpcore kept such a connection in a shared pool for good)."""
    p, d, served, base = stand_ins
    p.script = d.script = {"status": 200, "delay": 1.0}  # whatever reached them is still being answered
    port = int(base.rsplit(":", 1)[1])
    data = json.dumps(BODY).encode()
    for _ in range(120):
        with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
            sock.sendall(f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                         f"Content-Length: {len(data)}\r\n\r\n".encode() + data)
    time.sleep(2.0)  # every half dropped, every stand-in answer written
    held = _connections_to(p.port) + _connections_to(d.port)
    print(f"\nconnections to P and D after 120 clients left at once: {held}")
    assert held <= 4, held  # the router's keep-alive for its own /health and /server_info calls at most
    p.script = d.script = {"status": 200, "delay": 0.0}
    resp = httpx.post(base + "/v1/completions", json=BODY, timeout=10)
    assert resp.status_code == 200, resp.text
