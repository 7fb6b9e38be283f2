"""PD faults over real processes on 127.0.0.1 (a small random Llama, token-id prompts), beyond
test_pd_e2e.py (P frozen then killed with a room open), test_cluster.py (--disagg restarts a killed child)
and test_control_plane.py (a busy P is not a dead one):

(a) P SIGKILLed while a room's KV write is in flight: the client gets an error by the heartbeat rule, the
    requests on the other P complete, D's and the other P's pages come back, and service resumes;
(b) P frozen (SIGSTOP) with a room open on D2 and thawed (SIGCONT) well before its heartbeat timeout: the
    request completes with the right tokens, nothing else fails, nothing leaks;
(c) P SIGKILLed and restarted on the same HTTP and bootstrap ports (a new control endpoint): D asks the
    bootstrap server again and the next request succeeds, also when P is back before D's heartbeat timeout
    passed since D last heard from it (D trusts a cached route only briefly); a request while P is down
    waits for it (the router's --pd-restart-wait), then gets 503 with Retry-After naming it (never a 502);
(d) the router SIGKILLed mid-stream and restarted on the same port: the client's stream ends with an
    error, P and D free the room, and the new router serves its first request;
(e) D's bootstrap server unreachable -> 502 from D; D's Abort to an idle P (a room P never got a request
    for) is acked at once, not at P's next request.
(f) clients leaving mid-stream: no orphaned reads of D's stream in the router, every room freed.

One cluster per module, started by hand on fixed ports so a victim comes back on its own ports: two
prefill servers P1 and P2 with one decode server D, router A (P1 + D) and router B (P2 + D), so requests
through B are the ones not involved in a fault of P1; a second decode server D2 with a long heartbeat
timeout behind router C (P1 + D2) for the fast restart (and, by hand, the freeze). Each test starts from every
server up and idle.

Times are printed, and bounded only where the bound is the behaviour, then well inside the next thing that
could have produced the same outcome (a longer timeout of D's, a client's timeout), so a loaded box does
not break them; a premise (a write in flight, P thawed in time) is observed or built, not hoped for.
"""
import concurrent.futures
import contextlib
import json
import os
import signal
import socket
import time

import httpx
import pytest

from specpd.server.launch import free_port
from tests.disagg.fault_cluster import (HEARTBEAT_TIMEOUT_S, LONG_HEARTBEAT_TIMEOUT_S, LONG_PROMPT, MODEL, SHORT, Cluster,
                                        assert_pages_back, bystanders, check_bystanders, info, post, tokens_of)

TRANSFER_TIMEOUT_S = 60.0  # D's --pd-transfer-timeout (default): the next rule after the heartbeat's to end a room
NOT_A_HANG_S = 30.0  # an answer "at once" comes well within this on any box; a hang runs into a 60 s client timeout
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
        # D2 trusting P1's old endpoint would fail the room only when its heartbeat timeout passed since it sent
        # the room (25 s): an answer before then came by the new route
        limit = LONG_HEARTBEAT_TIMEOUT_S - 5
        asked = time.monotonic()
        resp, at = post(up.url["c"], SHORT, timeout=limit)
        print(f"\nP1 restarted in {took:.1f} s; the first request through D2 answered in {at - asked:.2f} s")
        assert isinstance(resp, httpx.Response), f"no answer within {limit:g} s after P1 restarted: {resp!r}"
        assert tokens_of(resp) == reference
        for name in ("p1", "d2"):
            assert_pages_back(up.url[name], 10)
        done = True
    finally:
        if not done:  # a room stuck on D2 (and P1) until D2's heartbeat timeout: the next test restarts both
            up.kill("p1")
            up.kill("d2")


def test_prefill_killed_with_its_kv_write_in_flight(up, reference):
    """P1 SIGKILLed once it reports a write in flight (a 2,000-token prompt: 16 MB over tcp) while a fourth long
    prompt waits behind the three its pool holds: every request through P1 that P1 had not handed off (the
    fourth at least: it needs a whole prefill after one of the three is done) gets an error by the heartbeat
    rule, the ones through P2 complete, D's and P2's pages come back by the heartbeat rule (not the 600 s abort
    timeout), and the next request through P1's router, once P1 is back, succeeds."""
    def long_body(k: int) -> dict:  # its own prompt: no prefix cache (P's or D's) shortens a prefill or a write
        return {"prompt": [(t - 10 + k) % 300 + 10 for t in LONG_PROMPT], "max_tokens": 4, "temperature": 0,
                "ignore_eos": True}

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        others = bystanders(pool, up.url["b"], 3)
        deadline, rounds = time.monotonic() + 180, 0
        while True:  # a write in flight lasts about one engine step: a round whose writes all went unseen is redone
            rounds += 1
            # P1's pool holds 3 of them (375 of its 384 pages)
            victims = [pool.submit(post, up.url["a"], long_body(4 * rounds + i)) for i in range(4)]
            seen = None
            while seen is None and not all(v.done() for v in victims):
                got = info(up.url["p1"])
                if got["pd_inflight"] > 0 and got["pd_prefilling"] + got["pd_bootstrap"] + got["pd_parked"] > 0:
                    seen = got
                assert time.monotonic() < deadline, f"P1 never had a write in flight with a room behind it: {got}"
            if seen is not None:
                break
            for resp, _ in (v.result() for v in victims):  # not the case yet: all completed
                assert isinstance(resp, httpx.Response) and resp.status_code == 200, repr(resp)
        killed = up.kill("p1")
        results = [v.result(timeout=120) for v in victims]
        check_bystanders(others, reference)
    failed = [(r, at) for r, at in results if not (isinstance(r, httpx.Response) and r.status_code == 200)]
    print(f"\nround {rounds}: killed P1 with {seen['pd_inflight']} rooms in flight, "
          f"{seen['pd_prefilling'] + seen['pd_bootstrap'] + seen['pd_parked']} behind; {len(failed)} of "
          f"{len(results)} failed, after {[round(at - killed, 2) for _, at in failed]} s")
    assert failed, "the kill hit no request that P1 had not handed off"
    for resp, at in failed:
        assert isinstance(resp, httpx.Response) and resp.status_code >= 500, repr(resp)
        assert "prefill" in resp.json()["error"]["message"], resp.text
        # the heartbeat rule, or P1's connection dropped: well before D's transfer timeout could have
        assert at - killed < HEARTBEAT_TIMEOUT_S + 15 < TRANSFER_TIMEOUT_S, at - killed
    for resp, _ in results:  # a request P1 handed off before it died is D's to finish
        if isinstance(resp, httpx.Response) and resp.status_code == 200:
            assert resp.json()["usage"]["completion_tokens"] == 4, resp.text
    for name in ("d", "p2"):  # by the heartbeat rule (P1's port refuses: gone), not the 600 s abort timeout
        assert_pages_back(up.url[name], HEARTBEAT_TIMEOUT_S + 30)
    print(f"pages back on D and P2 {time.monotonic() - killed:.2f} s after the kill")
    up.ensure_up()  # P1 back on its ports: service resumes
    assert tokens_of(httpx.post(up.url["a"] + "/v1/completions", json=SHORT, timeout=60)) == reference


def test_prefill_frozen_and_thawed_before_the_heartbeat_timeout(up, reference):
    """A room open on D2 (its pages offered to P1, the request's half for P1 not sent yet: both halves are sent
    by hand, as the router would), then P1 SIGSTOPped, its half sent to it frozen, and P1 SIGCONTed after three
    of D2's heartbeat intervals, its pings unanswered, well inside D2's heartbeat timeout (25 s: the premise
    holds by construction; a thaw too late for it skips): the request completes with the right tokens, the
    requests through P2 during the freeze complete, and every server's pages come back. (Through a router the
    room could not be opened while P1 is frozen: D asks a P's bootstrap server for its route once it has not
    heard from P for 2 s, and a frozen one does not answer.)"""
    freeze_s = 3.0  # D2 pings P1 every second
    body = {**SHORT, "bootstrap_host": "127.0.0.1", "bootstrap_port": up.ports["boot1"], "bootstrap_room": 4242}
    try:
        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            decode = pool.submit(post, up.url["d2"], body, 120)
            deadline = time.monotonic() + 60
            while info(up.url["d2"])["pd_transfer"] < 1:  # D2 offered the room's pages to P1
                assert time.monotonic() < deadline and not decode.done(), f"D2 never offered: {decode}"
                time.sleep(0.02)
            os.kill(up.pid("p1"), signal.SIGSTOP)
            stopped = time.monotonic()
            prefill = pool.submit(post, up.url["p1"], body, 120)
            others = bystanders(pool, up.url["b"], 2)
            time.sleep(max(0.0, freeze_s - (time.monotonic() - stopped)))
            assert not decode.done() and not prefill.done()
            os.kill(up.pid("p1"), signal.SIGCONT)
            thawed = time.monotonic()
            (resp, at), (p_resp, _) = decode.result(timeout=120), prefill.result(timeout=120)
            check_bystanders(others, reference)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(up.pid("p1"), signal.SIGCONT)
    print(f"\nP1 frozen {thawed - stopped:.2f} s; D2 answered {at - thawed:.2f} s after the thaw")
    if thawed - stopped > LONG_HEARTBEAT_TIMEOUT_S - 5:
        pytest.skip(f"P1 was thawed {thawed - stopped:.1f} s after the freeze: too near D2's heartbeat timeout")
    assert isinstance(p_resp, httpx.Response) and p_resp.status_code == 200, repr(p_resp)
    assert isinstance(resp, httpx.Response), repr(resp)
    assert tokens_of(resp) == reference
    for name in ("p1", "p2", "d", "d2"):
        assert_pages_back(up.url[name], 30)
    assert up.procs["p1"].poll() is None


def restart(up, name: str) -> float:
    """Start `name` again on its ports; returns how long it took to answer /health."""
    t0 = time.monotonic()
    up.spawn(name)
    up.wait_healthy([name])
    return time.monotonic() - t0


def test_prefill_restarted_on_its_ports_is_found_again(up, reference):
    """P1 SIGKILLed while idle and restarted on the same HTTP and bootstrap ports (its control endpoint is a
    new random port): a request while P1 is down waits the router's restart wait, then gets 503 with Retry-After
    naming P1, D (whose heartbeat timeout passes
    while P1 restarts) asks P1's bootstrap server for the new route, and the first request through router A
    once P1 is healthy succeeds; P2's requests were never affected."""
    old_pid = up.pid("p1")
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        others = bystanders(pool, up.url["b"], 3)
        up.kill("p1")
        # while P1 is down: the router waits for it (P1's refused connection or D's unreachable bootstrap
        # server, whichever it hears first, marks P1 down), then a 503 with Retry-After, not a hang or a 502
        asked = time.monotonic()
        resp, at = post(up.url["a"], SHORT)
        print(f"\nwhile P1 is down: {getattr(resp, 'status_code', resp)!r} after {at - asked:.3f} s")
        assert isinstance(resp, httpx.Response), repr(resp)
        assert at - asked < NOT_A_HANG_S, at - asked
        assert resp.status_code == 503 and int(resp.headers["Retry-After"]) >= 1, resp.text
        assert f"prefill server {up.url['p1']} is down" in resp.json()["error"]["message"], resp.text
        restart(up, "p1")
        check_bystanders(others, reference)
    assert up.pid("p1") != old_pid
    resp, _ = post(up.url["a"], SHORT)
    assert isinstance(resp, httpx.Response), repr(resp)
    assert tokens_of(resp) == reference
    for name in ("p1", "p2", "d"):
        assert_pages_back(up.url[name], 30)


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
        broke = time.monotonic() - killed
        print(f"\nthe stream broke {broke:.3f} s after the router was killed")
        assert error is not None, "the stream ended cleanly although its router was killed"
        assert broke < NOT_A_HANG_S, broke
        for name in ("d", "p1"):
            assert_pages_back(up.url[name], 30)
        check_bystanders(others, reference)
        up.spawn("a")
        up.wait_healthy(["a"])
    resp, _ = post(up.url["a"], SHORT)
    assert isinstance(resp, httpx.Response), repr(resp)
    assert tokens_of(resp) == reference
    for name in ("p1", "p2", "d"):
        assert_pages_back(up.url[name], 30)


def test_unreachable_bootstrap_server_is_a_bad_gateway(up):
    """D asked to bootstrap from a port where no prefill server listens answers 502 naming it, not 400."""
    dead = free_port()
    resp = httpx.post(up.url["d"] + "/v1/completions", timeout=30, json={
        **SHORT, "bootstrap_host": "127.0.0.1", "bootstrap_port": dead, "bootstrap_room": 7})
    assert resp.status_code == 502, resp.text
    assert f"prefill bootstrap server 127.0.0.1:{dead} unreachable" in resp.json()["error"]["message"]
    assert_pages_back(up.url["d"], 30)


def test_idle_prefill_acks_an_abort_at_once(up):
    """A room D offered to an idle P1 that never gets the request for it (the router's request to P failed
    first), then abandoned by D's client: P1's control thread wakes its engine loop, which AbortAcks at once,
    so D's pages come back in well under D's 600 s abort timeout (printed: a second or two), not after it nor
    after P1's next request (there is none)."""
    body = {**SHORT, "max_tokens": 4, "stream": True, "bootstrap_host": "127.0.0.1",
            "bootstrap_port": up.ports["boot1"], "bootstrap_room": 991}
    with httpx.Client(timeout=30) as client:
        with client.stream("POST", up.url["d"] + "/v1/completions", json=body) as resp:
            assert resp.status_code == 200
            deadline = time.monotonic() + 30
            while info(up.url["d"])["pd_transfer"] < 1:  # D offered its pages to P1
                assert time.monotonic() < deadline, "D never offered pages for the room"
                time.sleep(0.02)
            # P1 answered two of D's heartbeats since: it had D's offer (sent ahead of them on the same socket)
            answered = info(up.url["p1"])["pd_heartbeats_answered"]
            while info(up.url["p1"])["pd_heartbeats_answered"] < answered + 2:
                assert time.monotonic() < deadline, "P1 never answered D's heartbeats for the room"
                time.sleep(0.05)
        left = time.monotonic()  # the client is gone: D sends Abort to P1
    assert_pages_back(up.url["d"], 60)
    print(f"\nD's pages back {time.monotonic() - left:.2f} s after its client left")
    assert_pages_back(up.url["p1"], 30)


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
    # a non-streamed request the client gives up on while D decodes it: the router closes D's connection, so D
    # aborts it rather than decoding all 3000 tokens for nobody (D's count of generated tokens says so)
    before = generated_tokens(up.url["d"])
    post_and_leave(up.url["b"], {**SHORT, "max_tokens": 3000}, lambda: info(up.url["d"])["num_running"] > 0)
    left = time.monotonic()
    assert_pages_back(up.url["d"], 30)
    made = generated_tokens(up.url["d"]) - before
    print(f"\nD freed the abandoned request {time.monotonic() - left:.2f} s after its client left, "
          f"{made:.0f} of 3000 tokens made")
    assert made < 3000, made
    assert tokens_of(httpx.post(up.url["b"] + "/v1/completions", json=SHORT, timeout=60)) == reference
    time.sleep(0.5)
    with open(up.logs["b"], encoding="utf-8", errors="replace") as f:
        log = f.read()
    assert "never retrieved" not in log, log[-3000:]


def generated_tokens(url: str) -> float:
    for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
        if line.startswith("specpd:generation_tokens_total"):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def post_and_leave(url: str, body: dict, leave_when) -> None:
    """POST `body` (not streamed) on a connection of our own and close it unanswered once `leave_when()`."""
    host, port = url.removeprefix("http://").split(":")
    data = json.dumps(body).encode()
    with socket.create_connection((host, int(port)), timeout=60) as sock:
        sock.sendall(f"POST /v1/completions HTTP/1.1\r\nHost: {host}:{port}\r\nContent-Type: application/json"
                     f"\r\nContent-Length: {len(data)}\r\n\r\n".encode() + data)
        deadline = time.monotonic() + 60
        while not leave_when():
            assert time.monotonic() < deadline, "the request never started"
            time.sleep(0.01)
