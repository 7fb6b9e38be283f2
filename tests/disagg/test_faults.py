"""PD faults over real processes on 127.0.0.1 (a small random Llama, token-id prompts), beyond
test_pd_e2e.py (P frozen then killed with a room open), test_cluster.py (--disagg restarts a killed child)
and test_control_plane.py (a busy P is not a dead one):

(a) P SIGKILLed while a room's KV write is in flight: the client gets an error within the bound, the
    requests on the other P complete, D's and the other P's pages come back, and service resumes;
(b) P frozen (SIGSTOP) with a room open on D and thawed (SIGCONT) before the heartbeat timeout: the
    request completes with the right tokens, nothing else fails, nothing leaks;
(c) P SIGKILLed and restarted on the same HTTP and bootstrap ports (a new control endpoint): D asks the
    bootstrap server again and the next request succeeds, also when P is back before D's heartbeat timeout
    passed since D last heard from it (D trusts a cached route only briefly); a request while P is down
    gets 502 (P's bootstrap server unreachable is a bad gateway, not a bad request);
(d) the router SIGKILLed mid-stream and restarted on the same port: the client's stream ends with an
    error, P and D free the room, and the new router serves its first request;
(e) D's bootstrap server unreachable -> 502 from D; D's Abort to an idle P (a room P never got a request
    for) is acked at once, not at P's next request.
(f) clients leaving mid-stream: no orphaned reads of D's stream in the router, every room freed.

One cluster per module, started by hand on fixed ports so a victim comes back on its own ports: two
prefill servers P1 and P2 with one decode server D, router A (P1 + D) and router B (P2 + D), so requests
through B are the ones not involved in a fault of P1; a second decode server D2 with a long heartbeat
timeout behind router C (P1 + D2) for the fast restart. Each test starts from every server up and idle.
"""
import concurrent.futures
import contextlib
import json
import os
import signal
import time

import httpx
import pytest

from specpd.server.launch import free_port
from tests.disagg.fault_cluster import (HEARTBEAT_TIMEOUT_S, LONG_HEARTBEAT_TIMEOUT_S, LONG_PROMPT, MODEL, SHORT, Cluster,
                                        assert_pages_back, bystanders, check_bystanders, info, post, tokens_of)
from tests.model.hf_models import save_tiny_model


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_llama_faults")
    save_tiny_model("llama", path, **MODEL)
    c = Cluster(str(path))
    try:
        for name in ("p1", "p2", "d", "d2"):
            c.spawn(name)
        c.wait_healthy(["p1", "p2", "d", "d2"])
        c.start(["a", "b", "c"])
        yield c
    finally:
        c.close()


@pytest.fixture(scope="module")
def reference(cluster) -> list[int]:
    """The greedy tokens of SHORT, as the healthy cluster gives them through both routers."""
    want = tokens_of(httpx.post(cluster.url["a"] + "/v1/completions", json=SHORT, timeout=60))
    for router in ("b", "c"):
        assert tokens_of(httpx.post(cluster.url[router] + "/v1/completions", json=SHORT, timeout=60)) == want
    return want


@pytest.fixture
def up(cluster, reference):
    cluster.ensure_up()
    return cluster


def test_prefill_restarted_within_the_heartbeat_timeout_is_found_again(up, reference):
    """(c) as D2 sees it (first in the module, while D2's route to P1 is fresh): D2's heartbeat timeout
    (25 s) is longer than P1's restart and D2 heard from P1 just before the kill, so its cached route names
    P1's old control endpoint; yet the first request through router C once P1 is healthy must succeed
    (not wait out the heartbeat timeout)."""
    done = False
    try:
        resp, _ = post(up.url["c"], SHORT, timeout=10)  # D2 hears from P1 (first in the module: a fresh route)
        assert isinstance(resp, httpx.Response) and tokens_of(resp) == reference, repr(resp)
        up.kill("p1")
        took = restart(up, "p1")
        if took > LONG_HEARTBEAT_TIMEOUT_S - 6:
            pytest.skip(f"P1 took {took:.1f} s to restart: D2's heartbeat timeout passed, the case did not arise")
        resp, _ = post(up.url["c"], SHORT, timeout=6)  # a healthy cluster answers in well under a second
        assert isinstance(resp, httpx.Response), f"no answer within 6 s after P1 restarted: {resp!r}"
        assert tokens_of(resp) == reference
        for name in ("p1", "d2"):
            assert_pages_back(up.url[name], 10)
        done = True
    finally:
        if not done:  # a room stuck on D2 (and P1) until D2's heartbeat timeout: the next test restarts both
            up.kill("p1")
            up.kill("d2")


def test_prefill_killed_with_its_kv_write_in_flight(up, reference):
    """P1 SIGKILLed as soon as it reports a write in flight (a 2,000-token prompt: 16 MB over tcp), with more
    long prompts queued behind it: every request through P1 that P1 had not handed off gets an error within
    the bound, the ones through P2 complete, D's and P2's pages come back within the heartbeat timeout (not
    the 600 s abort timeout), and the next request through P1's router, once P1 is back, succeeds."""
    long_body = {"prompt": LONG_PROMPT, "max_tokens": 4, "temperature": 0, "ignore_eos": True}
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        others = bystanders(pool, up.url["b"], 3)
        for _attempt in range(3):  # a fast machine may finish a round between two polls: another round
            victims = [pool.submit(post, up.url["a"], long_body) for _ in range(3)]
            deadline, seen = time.monotonic() + 60, False
            while not seen and not all(v.done() for v in victims):
                seen = info(up.url["p1"])["pd_inflight"] > 0
                assert time.monotonic() < deadline, "P1's requests neither finished nor wrote KV"
                time.sleep(0.005)
            if seen:
                break
            for resp, _ in (v.result() for v in victims):  # not the case yet: all completed
                assert isinstance(resp, httpx.Response) and resp.status_code == 200, repr(resp)
        assert seen, "P1 never had a KV write in flight"
        killed = up.kill("p1")
        results = [v.result(timeout=60) for v in victims]
        check_bystanders(others, reference)
    failed = [(r, at) for r, at in results if not (isinstance(r, httpx.Response) and r.status_code == 200)]
    assert failed, "the kill hit no request in flight"  # the one whose write was in flight at least
    for resp, at in failed:
        assert isinstance(resp, httpx.Response) and resp.status_code >= 500, repr(resp)
        assert "prefill" in resp.json()["error"]["message"], resp.text
        assert at - killed < HEARTBEAT_TIMEOUT_S + 2, at - killed
    for resp, _ in results:  # a request P1 handed off before it died is D's to finish
        if isinstance(resp, httpx.Response) and resp.status_code == 200:
            assert resp.json()["usage"]["completion_tokens"] == long_body["max_tokens"], resp.text
    for name in ("d", "p2"):  # by the heartbeat rule (P1's port refuses: gone), not the abort timeout
        assert_pages_back(up.url[name], HEARTBEAT_TIMEOUT_S + 5)
    assert time.monotonic() - killed < HEARTBEAT_TIMEOUT_S + 5
    up.ensure_up()  # P1 back on its ports: service resumes
    assert tokens_of(httpx.post(up.url["a"] + "/v1/completions", json=SHORT, timeout=60)) == reference


def test_prefill_frozen_and_thawed_before_the_heartbeat_timeout(up, reference):
    """P1 SIGSTOPped before a request reaches it (its room is offered on D while P1 is frozen) and SIGCONTed
    after a third of the heartbeat timeout: the request completes with the right tokens, the requests
    through P2 during the freeze complete, and every server's pages come back."""
    freeze_s = HEARTBEAT_TIMEOUT_S / 3
    os.kill(up.pid("p1"), signal.SIGSTOP)
    stopped = time.monotonic()
    try:
        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            frozen = pool.submit(post, up.url["a"], SHORT)
            others = bystanders(pool, up.url["b"], 2)
            deadline = time.monotonic() + 10
            while info(up.url["d"])["pd_transfer"] < 1:  # D offered the room's pages to the frozen P1
                assert time.monotonic() < deadline and not frozen.done(), "D never offered pages for the room"
                time.sleep(0.05)
            time.sleep(max(0.0, freeze_s - (time.monotonic() - stopped)))
            assert not frozen.done()
            os.kill(up.pid("p1"), signal.SIGCONT)
            thawed = time.monotonic()
            assert thawed - stopped < HEARTBEAT_TIMEOUT_S - 0.5, "the test itself was too slow to thaw P1 in time"
            resp, _ = frozen.result(timeout=60)
            check_bystanders(others, reference)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(up.pid("p1"), signal.SIGCONT)
    assert isinstance(resp, httpx.Response), repr(resp)
    assert tokens_of(resp) == reference
    for name in ("p1", "p2", "d"):
        assert_pages_back(up.url[name], 10)
    assert up.procs["p1"].poll() is None


def restart(up, name: str) -> float:
    """Start `name` again on its ports; returns how long it took to answer /health."""
    t0 = time.monotonic()
    up.spawn(name)
    up.wait_healthy([name])
    return time.monotonic() - t0


def test_prefill_restarted_on_its_ports_is_found_again(up, reference):
    """P1 SIGKILLed while idle and restarted on the same HTTP and bootstrap ports (its control endpoint is a
    new random port): a request while P1 is down gets a clear error, D (whose heartbeat timeout passes
    while P1 restarts) asks P1's bootstrap server for the new route, and the first request through router A
    once P1 is healthy succeeds; P2's requests were never affected."""
    old_pid = up.pid("p1")
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        others = bystanders(pool, up.url["b"], 3)
        up.kill("p1")
        # while P1 is down: a clear error at once, not a hang (P1's refused connection or D's unreachable
        # bootstrap server, whichever the router hears first: both a 502)
        asked = time.monotonic()
        resp, at = post(up.url["a"], SHORT)
        assert isinstance(resp, httpx.Response), repr(resp)
        assert at - asked < 10, at - asked
        assert resp.status_code == 502 and "prefill" in resp.json()["error"]["message"], resp.text
        restart(up, "p1")
        check_bystanders(others, reference)
    assert up.pid("p1") != old_pid
    resp, _ = post(up.url["a"], SHORT)
    assert isinstance(resp, httpx.Response), repr(resp)
    assert tokens_of(resp) == reference
    for name in ("p1", "p2", "d"):
        assert_pages_back(up.url[name], 10)


def test_router_restarted_on_its_port_serves_at_once(up, reference):
    """Router A SIGKILLed while it streams a long decode: the client's stream breaks, D and P1 free the room
    (D sees its client go), router B's requests complete, and a new router process on A's port serves its
    first request."""
    body = {**SHORT, "max_tokens": 300, "stream": True}
    with concurrent.futures.ThreadPoolExecutor(4) as pool, httpx.Client(timeout=60) as client:
        others = bystanders(pool, up.url["b"], 2)
        error = None
        with client.stream("POST", up.url["a"] + "/v1/completions", json=body) as resp:
            assert resp.status_code == 200
            lines = resp.iter_lines()
            try:
                for line in lines:
                    if line.startswith("data: "):
                        chunk = json.loads(line[len("data: "):])
                        assert "error" not in chunk, chunk
                        break  # D is decoding: kill the router under the stream
                killed = up.kill("a")
                for _ in lines:
                    pass
            except httpx.HTTPError as e:
                error = e
        assert error is not None, "the stream ended cleanly although its router was killed"
        assert time.monotonic() - killed < 10
        for name in ("d", "p1"):
            assert_pages_back(up.url[name], 15)
        check_bystanders(others, reference)
        up.spawn("a")
        up.wait_healthy(["a"], 60)
    resp, _ = post(up.url["a"], SHORT)
    assert isinstance(resp, httpx.Response), repr(resp)
    assert tokens_of(resp) == reference
    for name in ("p1", "p2", "d"):
        assert_pages_back(up.url[name], 10)


def test_unreachable_bootstrap_server_is_a_bad_gateway(up):
    """D asked to bootstrap from a port where no prefill server listens answers 502 naming it, not 400."""
    dead = free_port()
    resp = httpx.post(up.url["d"] + "/v1/completions", timeout=30, json={
        **SHORT, "bootstrap_host": "127.0.0.1", "bootstrap_port": dead, "bootstrap_room": 7})
    assert resp.status_code == 502, resp.text
    assert f"prefill bootstrap server 127.0.0.1:{dead} unreachable" in resp.json()["error"]["message"]
    assert_pages_back(up.url["d"], 5)


def test_idle_prefill_acks_an_abort_at_once(up):
    """A room D offered to an idle P1 that never gets the request for it (the router's request to P failed
    first), then abandoned by D's client: P1's control thread wakes its engine loop, which AbortAcks at once,
    so D's pages come back within a second or two, not after D's 600 s abort timeout nor P1's next request."""
    body = {**SHORT, "max_tokens": 4, "stream": True, "bootstrap_host": "127.0.0.1",
            "bootstrap_port": up.ports["boot1"], "bootstrap_room": 991}
    with httpx.Client(timeout=30) as client:
        with client.stream("POST", up.url["d"] + "/v1/completions", json=body) as resp:
            assert resp.status_code == 200
            deadline = time.monotonic() + 10
            while info(up.url["d"])["pd_transfer"] < 1:  # D offered its pages to P1
                assert time.monotonic() < deadline, "D never offered pages for the room"
                time.sleep(0.02)
            time.sleep(0.3)  # P1 has registered the room and gone idle again (no request came)
        left = time.monotonic()  # the client is gone: D sends Abort to P1
    assert_pages_back(up.url["d"], 3)
    assert time.monotonic() - left < 3
    assert_pages_back(up.url["p1"], 1)


def test_clients_leaving_mid_stream_leave_no_orphaned_reads_in_the_router(up, reference):
    """(f) Streams closed by their clients after the first tokens, some while the router waits on D's next
    chunk, and a non-streamed request its client gives up on: D and P free every room (the abandoned
    non-streamed one at once, not after decoding it), the router logs no task whose error nobody took (each
    abandoned read of D's stream is cancelled and its outcome retrieved), and it serves the next request."""
    body = {**SHORT, "max_tokens": 200, "stream": True}

    def leave_early(wait_s: float) -> None:
        with httpx.Client(timeout=60) as client:
            with client.stream("POST", up.url["b"] + "/v1/completions", json=body) as resp:
                assert resp.status_code == 200
                for i, _ in enumerate(resp.iter_raw()):
                    if i == 2:
                        time.sleep(wait_s)  # mid-wait for D's next chunk, or between chunks
                        return

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        list(pool.map(leave_early, [0.0, 0.01, 0.03, 0.05] * 6))
    for url in (up.url["d"], up.url["p2"]):
        assert_pages_back(url, 30)
    # a non-streamed request the client gives up on: the router closes D's connection, so D aborts it
    # rather than decoding all 3000 tokens for nobody
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(up.url["b"] + "/v1/completions", json={**SHORT, "max_tokens": 3000}, timeout=1.0)
    left = time.monotonic()
    assert_pages_back(up.url["d"], 10)
    assert time.monotonic() - left < 5
    assert tokens_of(httpx.post(up.url["b"] + "/v1/completions", json=SHORT, timeout=60)) == reference
    time.sleep(0.5)
    with open(up.logs["b"], encoding="utf-8", errors="replace") as f:
        log = f.read()
    assert "never retrieved" not in log, log[-3000:]
