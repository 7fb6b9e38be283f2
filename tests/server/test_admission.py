"""Admission over a real `specpd serve` (SmolLM2-135M) on 127.0.0.1: API key, body size, prompt length, queue.

The server runs with --api-key, --max-queued-requests 1 and --max-running-requests 1 (so a second request
waits deterministically), and the default --max-request-bytes (8 MiB). After every test the KV pool is back
to its total. "At once" is shown by what had not happened yet when the answer came (the body not sent, the
queue not moved), never by a clock; the times are printed.
"""
import concurrent.futures
import json
import socket
import time

import httpx
import pytest

from tests.server.launcher import launch_server

KEY = "test-key-123"
AUTH = {"Authorization": f"Bearer {KEY}"}
MAX_MODEL_LEN = 1024
BIG = 30_000_000  # the reported case: a 30 MB /v1/completions body
NORMAL = {"prompt": "The capital of France is", "max_tokens": 8, "temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def server():
    with launch_server(["--model", "default", "--max-model-len", str(MAX_MODEL_LEN), "--kv-cache-memory-mb", "64",
                        "--api-key", KEY, "--max-queued-requests", "1", "--max-running-requests", "1",
                        "--log-level", "warning"]) as srv:
        yield srv


@pytest.fixture
def client(server):
    with httpx.Client(base_url=server["base"], headers=AUTH, timeout=120) as c:
        yield c
        deadline = time.monotonic() + 30
        while (info := c.get("/server_info").json())["free_pages"] != server["total_pages"] or info["num_running"]:
            assert time.monotonic() < deadline, f"KV pages not returned: {info['free_pages']}/{server['total_pages']}"
            time.sleep(0.1)


def _timed(fn, *args, **kwargs):
    start = time.perf_counter()
    resp = fn(*args, **kwargs)
    return resp, time.perf_counter() - start


def _chunked(total: int, piece: int = 1 << 20):
    """A body with no Content-Length (httpx sends a generator chunked)."""
    yield b'{"prompt": "'
    for _ in range(total // piece):
        yield b"a" * piece
    yield b'", "max_tokens": 4}'


def answer_mid_upload(base: str, headers: dict[str, str], declared: int | None, send_bytes: int) -> tuple[int, dict]:
    """POST /v1/completions on a connection of our own: the headers (Content-Length `declared`, or chunked
    when None), then only `send_bytes` of the body, then read the answer while sending nothing more. An answer
    at all proves the server gave it before the rest of the body: the rest never comes. (status, JSON body)"""
    host, port = base.removeprefix("http://").split(":")
    head = ["POST /v1/completions HTTP/1.1", f"Host: {host}:{port}", "Content-Type: application/json",
            *(f"{k}: {v}" for k, v in headers.items())]
    head.append(f"Content-Length: {declared}" if declared is not None else "Transfer-Encoding: chunked")
    with socket.create_connection((host, int(port)), timeout=60) as sock:  # the server waits for the rest
        sock.sendall(("\r\n".join(head) + "\r\n\r\n").encode())
        body = (b'{"prompt": "' + b"a" * send_bytes)[:send_bytes]
        for i in range(0, send_bytes, 1 << 20):
            piece = body[i:i + (1 << 20)]
            sock.sendall(piece if declared is not None else b"%x\r\n%s\r\n" % (len(piece), piece))
        reply = b""
        while b"\r\n\r\n" not in reply:
            more = sock.recv(65536)
            assert more, "the server closed without answering"
            reply += more
        status_and_headers, body = reply.split(b"\r\n\r\n", 1)
        lines = status_and_headers.decode().split("\r\n")
        length = next(int(line.split(":", 1)[1]) for line in lines if line.lower().startswith("content-length:"))
        while len(body) < length:
            more = sock.recv(65536)
            assert more, f"the answer ended after {len(body)} of {length} bytes"
            body += more
    return int(lines[0].split()[1]), json.loads(body[:length])


def check_413(status: int, body: dict) -> None:
    assert status == 413, (status, body)
    err = body["error"]
    assert err["code"] == 413 and err["param"] == "body" and "8388608" in err["message"], err


def test_oversized_bodies_get_413_fast_while_a_normal_request_completes(client):
    """A 30 MB body is refused with 413 before it is sent: from its Content-Length alone, and, chunked, once 9
    of its MiB passed the 8 MiB limit, the rest withheld. Uploaded whole by httpx (which reads nothing until
    its body is sent) it is still a 413, not a reset; a normal request beside them completes."""
    big = b'{"prompt": "' + b"a" * BIG + b'", "max_tokens": 4}'
    headers = {**AUTH, "Content-Type": "application/json"}
    base = str(client.base_url).rstrip("/")
    with concurrent.futures.ThreadPoolExecutor(5) as pool:
        normal = pool.submit(_timed, client.post, "/v1/completions", json=NORMAL)
        withheld = [pool.submit(answer_mid_upload, base, AUTH, BIG, 0),
                    pool.submit(answer_mid_upload, base, AUTH, None, 9 << 20)]
        sized = pool.submit(_timed, httpx.post, client.base_url.join("/v1/completions"), content=big,
                            headers=headers, timeout=60)
        chunked = pool.submit(_timed, httpx.post, client.base_url.join("/v1/completions"), content=_chunked(BIG),
                              headers=headers, timeout=60)
        for future in withheld:
            check_413(*future.result())
        times = {}
        for future, what in ((sized, "Content-Length"), (chunked, "chunked")):
            resp, times[what] = future.result()
            check_413(resp.status_code, resp.json())
        resp, times["normal"] = normal.result()
    print(f"\n413 uploading 30 MB with httpx: {times['Content-Length']:.2f} s (Content-Length), "
          f"{times['chunked']:.2f} s (chunked); the normal request beside them: {times['normal']:.2f} s")
    assert resp.status_code == 200, resp.text
    assert resp.json()["usage"]["completion_tokens"] == 8
    assert client.post("/v1/completions", json=NORMAL).json()["choices"][0]["text"] == resp.json()["choices"][0]["text"]


def test_a_body_at_the_limit_is_parsed_not_refused(client):
    body = b'{"prompt": [1, 2, 3], "max_tokens": 2, "pad": "' + b" " * (8 * 1024 * 1024 - 100) + b'"}'
    assert len(body) <= 8 * 1024 * 1024
    resp = client.post("/v1/completions", content=body, headers={"Content-Type": "application/json"})
    assert resp.status_code == 200, resp.text[:300]


def test_prompt_text_that_cannot_fit_the_context_is_400_naming_the_field(client):
    # SmolLM2's longest token is 81 characters, so 1024 * 81 characters may still fit; one more cannot
    too_long = "a" * (MAX_MODEL_LEN * 81 + 1)
    resp = client.post("/v1/completions", json={"prompt": too_long, "max_tokens": 4})
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "prompt", resp.text[:300]
    assert "cannot fit the context of 1024 tokens" in resp.json()["error"]["message"]
    resp = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": too_long}]})
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "messages", resp.text[:300]


def test_the_length_bound_refuses_no_prompt_that_fits(client):
    """81 characters per token is real (a newline and 80 spaces is one token): 1000 of them fit in 1024
    tokens, though a bound of 32 characters per token would refuse their 81,000 characters."""
    prompt = ("\n" + " " * 80) * 1000
    resp = client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 2, "ignore_eos": True})
    assert resp.status_code == 200, resp.text[:300]
    assert resp.json()["usage"]["prompt_tokens"] == 1000


def test_api_key_required_on_all_but_the_read_only_routes(server, client):
    base = server["base"]
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}):
        resp = httpx.post(base + "/v1/completions", json=NORMAL, headers=headers)
        assert resp.status_code == 401, (headers, resp.text)
        err = resp.json()["error"]
        assert err["code"] == 401 and err["type"] == "authentication_error" and "API key" in err["message"]
    assert httpx.get(base + "/v1/models").status_code == 401
    assert httpx.post(base + "/v1/chat/completions", json={"messages": []}).status_code == 401
    for method in ("GET", "POST"):  # an admin route that changes state
        assert httpx.request(method, base + "/flush_cache").status_code == 401
    assert httpx.get(base + "/health").status_code == 200
    assert httpx.get(base + "/metrics").status_code == 200
    assert httpx.get(base + "/server_info").status_code == 200
    assert client.get("/v1/models").status_code == 200
    assert client.post("/flush_cache").status_code == 200
    assert client.post("/v1/completions", json=NORMAL).status_code == 200


def test_full_queue_is_503_with_retry_after(client):
    """One request runs (--max-running-requests 1), one waits (--max-queued-requests 1): a third is refused
    at once with Retry-After; the waiting one still completes once the running one leaves."""
    # as long as the context allows: the queue must not move while the test looks (the test ends it early)
    long_body = {"prompt": "Count to a thousand:", "max_tokens": MAX_MODEL_LEN - 16, "temperature": 0,
                 "ignore_eos": True, "stream": True}
    with client.stream("POST", "/v1/completions", json=long_body) as running:
        lines = running.iter_lines()
        assert next(line for line in lines if line.startswith("data: {"))  # it has its first token
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            waiting = pool.submit(client.post, "/v1/completions", json=NORMAL)
            deadline = time.monotonic() + 20
            while client.get("/server_info").json()["num_queued"] != 1:
                assert time.monotonic() < deadline and not waiting.done(), "the second request never queued"
                time.sleep(0.05)
            refused, seconds = _timed(client.post, "/v1/completions", json=NORMAL)
            assert refused.status_code == 503, refused.text
            assert int(refused.headers["Retry-After"]) >= 1
            err = refused.json()["error"]
            assert err["code"] == 503 and "max-queued-requests" in err["message"], err
            chat = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]})
            assert chat.status_code == 503 and "Retry-After" in chat.headers
            print(f"\n503 after {1000 * seconds:.1f} ms")
            assert not waiting.done()  # refused at once: before the queue moved
            running.close()  # the client leaves: the running request is aborted, the waiting one runs
            resp = waiting.result(timeout=60)
    assert resp.status_code == 200 and resp.json()["usage"]["completion_tokens"] == 8, resp.text
    assert client.post("/v1/completions", json=NORMAL).status_code == 200


def _rejected(client, param: str) -> float:
    for line in client.get("/metrics").text.splitlines():
        if line.startswith("specpd:requests_rejected_total{") and f'param="{param}"' in line:
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def test_refusals_at_the_door_are_counted(server, client):
    before = {p: _rejected(client, p) for p in ("body", "api_key")}
    assert httpx.post(server["base"] + "/v1/completions", json=NORMAL).status_code == 401
    assert client.post("/v1/completions", content=b"x" * (8 * 1024 * 1024 + 1)).status_code == 413
    assert _rejected(client, "api_key") == before["api_key"] + 1
    assert _rejected(client, "body") == before["body"] + 1


def test_a_refused_upload_still_reads_its_answer(server, client):
    """The server reads (and drops) the rest of a refused body before it closes: closing on unread data
    resets the connection, and an uploading asyncio client then gets a ReadError instead of the 413 / 401."""
    import asyncio

    async def post(headers):
        async with httpx.AsyncClient(timeout=60) as c:
            resp = await c.post(server["base"] + "/v1/completions", content=b"a" * 20_000_000,
                                headers={"Content-Type": "application/json", **headers})
            return resp.status_code

    async def both():
        return await asyncio.gather(*(post(AUTH) for _ in range(3)), post({}))
    assert asyncio.run(both()) == [413, 413, 413, 401]
