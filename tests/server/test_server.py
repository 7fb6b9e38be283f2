"""The real server in a subprocess (`python -m specpd serve`, SmolLM2-135M), called over HTTP.

After every test the KV pool must be back to its baseline free-page count (no leaked pages).
"""
import json
import threading
import time

import httpx
import pytest

from tests.server.launcher import launch_server

MAX_MODEL_LEN = 1024


@pytest.fixture(scope="module")
def server():
    with launch_server(["--model", "default", "--max-model-len", str(MAX_MODEL_LEN), "--served-model-name",
                        "smollm2", "default", "--kv-cache-memory-mb", "64", "--log-level", "warning"]) as srv:
        yield srv


@pytest.fixture
def client(server):
    yield server["client"]
    _wait_idle(server)


def _wait_idle(server, timeout_s: float = 15.0) -> dict:
    """Poll /server_info until no request runs and every page is free again."""
    deadline = time.monotonic() + timeout_s
    while True:
        info = server["client"].get("/server_info").json()
        idle = info["num_running"] == 0 and info["num_waiting"] == 0
        if idle and info["free_pages"] == server["total_pages"]:
            return info
        if time.monotonic() > deadline:
            pytest.fail(f"KV pages not returned: {info['free_pages']}/{server['total_pages']} free, "
                        f"{info['num_running']} running, {info['num_waiting']} waiting")
        time.sleep(0.1)


def _sse(response: httpx.Response) -> list:
    """Parsed `data:` payloads of a stream; the final [DONE] as the string "[DONE]"."""
    events = []
    for line in response.iter_lines():
        if line.startswith("data: "):
            data = line[len("data: "):]
            events.append(data if data == "[DONE]" else json.loads(data))
        else:
            assert line == "", line
    return events


PROMPT = "The capital of France is"


def _complete(client, **body):
    r = client.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 6, "temperature": 0, **body})
    assert r.status_code == 200, r.text
    return r.json()


# -- completions -----------------------------------------------------------------------------
def test_completion(client, server):
    body = _complete(client, model=server["model"])
    assert body["object"] == "text_completion" and body["id"].startswith("cmpl-")
    assert body["model"] == server["model"] and isinstance(body["created"], int)
    choice = body["choices"][0]
    assert choice["index"] == 0 and choice["text"] and choice["finish_reason"] == "length"
    assert choice["logprobs"] is None
    usage = body["usage"]
    assert usage["completion_tokens"] == 6 and usage["prompt_tokens"] > 0
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]


def test_completion_stream_matches_non_stream(client):
    expected = _complete(client)["choices"][0]["text"]
    with client.stream("POST", "/v1/completions", json={"prompt": PROMPT, "max_tokens": 6, "temperature": 0,
                                                        "stream": True}) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        events = _sse(r)
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert all(c["object"] == "text_completion" and "usage" not in c for c in chunks)
    assert "".join(c["choices"][0]["text"] for c in chunks) == expected
    assert [c["choices"][0]["finish_reason"] for c in chunks][-1] == "length"


def test_prompt_as_token_ids(client):
    body = _complete(client, prompt=[504, 2988, 314], max_tokens=2)
    assert body["usage"]["prompt_tokens"] == 3 and body["usage"]["completion_tokens"] == 2


def test_completion_logprobs(client):
    body = _complete(client, logprobs=3)
    lp = body["choices"][0]["logprobs"]
    n = body["usage"]["completion_tokens"]
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == len(lp["text_offset"]) == n
    assert "".join(lp["tokens"]) == body["choices"][0]["text"]
    for token, chosen, top in zip(lp["tokens"], lp["token_logprobs"], lp["top_logprobs"]):
        assert chosen <= 0 and 1 <= len(top) <= 4
        assert top[token] == pytest.approx(chosen)
        assert chosen == pytest.approx(max(top.values()), abs=1e-4)  # greedy picks the best


def test_seeded_sampling_is_reproducible(client):
    texts = [_complete(client, temperature=1.0, top_p=0.95, seed=1234, max_tokens=8)["choices"][0]["text"]
             for _ in range(2)]
    assert texts[0] == texts[1]


def test_stop_string(client):
    full = _complete(client, max_tokens=8)["choices"][0]["text"]
    words = full.split()
    assert len(words) >= 2, full
    stop = words[1]
    body = _complete(client, max_tokens=8, stop=[stop, "never-appears"])
    choice = body["choices"][0]
    assert choice["finish_reason"] == "stop" and choice["stop_reason"] == stop
    assert choice["text"] == full[:full.index(stop)]


# -- chat ------------------------------------------------------------------------------------
MESSAGES = [{"role": "user", "content": "Say hello."}]


def test_chat(client, server):
    r = client.post("/v1/chat/completions", json={"model": server["model"], "messages": MESSAGES,
                                                  "max_tokens": 6, "temperature": 0})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "chat.completion" and body["id"].startswith("chatcmpl-")
    choice = body["choices"][0]
    assert choice["message"]["role"] == "assistant" and choice["message"]["content"]
    assert choice["finish_reason"] in ("stop", "length")
    assert body["usage"]["prompt_tokens"] > 5 and body["usage"]["completion_tokens"] <= 6


def test_chat_stream_with_usage(client):
    r = client.post("/v1/chat/completions", json={"messages": MESSAGES, "max_completion_tokens": 6,
                                                  "temperature": 0})
    expected = r.json()["choices"][0]["message"]["content"]
    with client.stream("POST", "/v1/chat/completions", json={
            "messages": MESSAGES, "max_completion_tokens": 6, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}) as r:
        assert r.status_code == 200
        events = _sse(r)
    assert events[-1] == "[DONE]"
    chunks, usage_chunk = events[:-2], events[-2]
    assert all(c["object"] == "chat.completion.chunk" and c["usage"] is None for c in chunks)
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks) == expected
    assert chunks[-1]["choices"][0]["finish_reason"] in ("stop", "length")
    assert usage_chunk["choices"] == [] and 0 < usage_chunk["usage"]["completion_tokens"] <= 6
    u = usage_chunk["usage"]
    assert u["total_tokens"] == u["prompt_tokens"] + u["completion_tokens"]


def test_chat_logprobs(client):
    r = client.post("/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": 4, "temperature": 0,
                                                  "logprobs": True, "top_logprobs": 2})
    body = r.json()
    content = body["choices"][0]["logprobs"]["content"]
    assert len(content) == body["usage"]["completion_tokens"]
    for entry in content:
        assert entry["logprob"] <= 0 and isinstance(entry["token"], str) and isinstance(entry["bytes"], list)
        assert len(entry["top_logprobs"]) == 2
        assert entry["logprob"] == pytest.approx(entry["top_logprobs"][0]["logprob"], abs=1e-4)


# -- n > 1, served names, logit_bias -----------------------------------------------------------
def test_parallel_samples(client):
    """n seeded samples: choice i is what a request with seed + i gets alone; usage counts the prompt once."""
    body = {"prompt": PROMPT, "max_tokens": 6, "temperature": 1.0, "seed": 11, "ignore_eos": True}
    alone = [client.post("/v1/completions", json={**body, "seed": 11 + i}).json()["choices"][0]["text"]
             for i in range(3)]
    r = client.post("/v1/completions", json={**body, "n": 3})
    assert r.status_code == 200, r.text
    out = r.json()
    assert [c["index"] for c in out["choices"]] == [0, 1, 2]
    assert [c["text"] for c in out["choices"]] == alone
    single = client.post("/v1/completions", json=body).json()["usage"]
    assert out["usage"]["prompt_tokens"] == single["prompt_tokens"] and out["usage"]["completion_tokens"] == 18


def test_parallel_samples_stream(client):
    body = {"messages": MESSAGES, "max_tokens": 5, "temperature": 0, "n": 2, "ignore_eos": True}
    expected = [c["message"]["content"] for c in client.post("/v1/chat/completions", json=body).json()["choices"]]
    with client.stream("POST", "/v1/chat/completions", json={**body, "stream": True,
                                                             "stream_options": {"include_usage": True}}) as r:
        events = _sse(r)
    texts, finished = ["", ""], set()
    for c in events[:-2]:
        choice = c["choices"][0]
        texts[choice["index"]] += choice["delta"].get("content") or ""
        if choice["finish_reason"]:
            finished.add(choice["index"])
    assert texts == expected and finished == {0, 1} and expected[0] == expected[1]  # greedy: the same text
    assert events[-2]["usage"]["completion_tokens"] == 10 and events[-1] == "[DONE]"


def test_logit_bias_steers_greedy_decoding(client):
    tokens = client.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 3, "temperature": 0,
                                                  "logprobs": 0}).json()["choices"][0]["logprobs"]["tokens"]
    forced = client.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 3, "temperature": 0,
                                                  "logit_bias": {"42": 100}, "return_tokens_as_token_ids": True,
                                                  "logprobs": 0}).json()["choices"][0]["logprobs"]["tokens"]
    assert forced == ["token_id:42"] * 3 and tokens != forced


# -- errors ----------------------------------------------------------------------------------
_TOO_LONG = [504] * (MAX_MODEL_LEN + 10)

BAD_REQUESTS = [
    ("/v1/completions", '{"prompt": "hi", ', "body"),
    ("/v1/completions", {"prompt": "hi", "model": "no-such-model"}, "model"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 0}, "max_tokens"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": -5}, "max_tokens"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": "lots"}, "max_tokens"),
    ("/v1/completions", {"prompt": "hi", "temperature": -1}, "temperature"),
    ("/v1/completions", {"prompt": "hi", "top_p": 0}, "top_p"),
    ("/v1/completions", {"prompt": "hi", "top_p": 1.5}, "top_p"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 100_000}, "max_tokens"),
    ("/v1/completions", {"prompt": _TOO_LONG, "max_tokens": 1}, ("prompt", "max_tokens")),
    ("/v1/completions", {"prompt": ""}, "prompt"),
    ("/v1/completions", {"prompt": []}, "prompt"),
    ("/v1/completions", {"prompt": ["a", "b"]}, "prompt"),
    ("/v1/completions", {"prompt": [10 ** 9]}, "prompt"),
    ("/v1/completions", {}, "prompt"),
    ("/v1/completions", {"prompt": "hi", "n": 0}, "n"),
    ("/v1/completions", {"prompt": "hi", "echo": True}, "echo"),
    ("/v1/completions", {"prompt": "hi", "logprobs": 99}, "logprobs"),
    ("/v1/chat/completions", {"messages": []}, "messages"),
    ("/v1/chat/completions", {"messages": MESSAGES, "max_completion_tokens": 0}, "max_completion_tokens"),
    ("/v1/chat/completions", {"messages": MESSAGES, "top_logprobs": 2}, "top_logprobs"),
    ("/v1/chat/completions", {"messages": MESSAGES, "stream_options": {"include_usage": True}}, "stream_options"),
    ("/v1/chat/completions", {"messages": MESSAGES, "model": "gpt-4o"}, "model"),
    ("/v1/chat/completions", {"messages": MESSAGES, "temperature": -2, "stream": True}, "temperature"),
]


@pytest.mark.parametrize("path, body, param", BAD_REQUESTS,
                         ids=[f"{p.split('/')[-1]}-{i}" for i, (p, _, _) in enumerate(BAD_REQUESTS)])
def test_bad_request_is_400_naming_the_field(client, path, body, param):
    if isinstance(body, str):
        r = client.post(path, content=body, headers={"content-type": "application/json"})
    else:
        r = client.post(path, json=body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    params = param if isinstance(param, tuple) else (param,)
    assert error["param"] in params and error["type"] == "invalid_request_error" and error["code"] == 400
    assert error["param"] in error["message"]
    assert client.get("/health").status_code == 200


def test_still_serving_after_bad_requests(client):
    assert _complete(client, max_tokens=2)["usage"]["completion_tokens"] == 2


def test_unknown_route_is_openai_shaped_404(client):
    r = client.get("/v1/nope")
    assert r.status_code == 404 and "error" in r.json()


# -- info endpoints --------------------------------------------------------------------------
def test_models(client, server):
    body = client.get("/v1/models").json()
    assert body["object"] == "list"
    assert [m["id"] for m in body["data"]] == [server["model"], "default"] == ["smollm2", "default"]
    assert body["data"][0]["max_model_len"] == MAX_MODEL_LEN
    for alias in ("smollm2", "default"):  # any served name; the response carries the first
        r = client.post("/v1/completions", json={"model": alias, "prompt": PROMPT, "max_tokens": 1})
        assert r.status_code == 200 and r.json()["model"] == "smollm2"


def test_server_info(client, server):
    info = client.get("/server_info").json()
    assert info["pid"] == server["proc"].pid and info["role"] == "unified"
    assert info["total_pages"] > 0 and 0 <= info["free_pages"] <= info["total_pages"]
    assert info["config"]["model"] == "default" and info["config"]["cache"]["kv_cache_memory_mb"] == 64
    assert info["max_model_len"] == MAX_MODEL_LEN
    huge = info["huge_pages"]  # the suite's servers ask for none (SPECPD_HUGE_PAGES=0, tests/conftest.py)
    assert huge["resident_mib"] > 100 and 0 <= huge["on_huge_pages_mib"] <= huge["resident_mib"]
    assert huge["collapse_after_start_up"]["state"] in ("none", "off")


def test_metrics(client):
    _complete(client, max_tokens=2)
    text = client.get("/metrics").text
    for name in ("specpd:requests_finished_total", "specpd:prompt_tokens_total", "specpd:generation_tokens_total",
                 "specpd:time_to_first_token_seconds_bucket", "specpd:time_per_output_token_seconds_bucket",
                 "specpd:e2e_request_latency_seconds_bucket", "specpd:num_requests_running",
                 "specpd:num_requests_waiting", "specpd:kv_pages_free", "specpd:kv_pages_total",
                 "specpd:requests_rejected_total"):
        assert name in text, name
    assert _metric(text, "specpd:requests_finished_total", 'finish_reason="length"') >= 1


def _metric(text: str, name: str, label: str = "") -> float:
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name) and label in line:
            total += float(line.rsplit(" ", 1)[1])
    return total


def _aborted(client) -> float:
    return _metric(client.get("/metrics").text, "specpd:requests_finished_total", 'finish_reason="abort"')


def _wait_aborted(client, before: float, timeout_s: float = 15.0) -> None:
    deadline = time.monotonic() + timeout_s
    while _aborted(client) < before + 1:
        assert time.monotonic() < deadline, "the request was not aborted"
        time.sleep(0.1)


# -- disconnects and concurrency -------------------------------------------------------------
LONG = {"prompt": "Once upon a time", "max_tokens": 400, "ignore_eos": True, "temperature": 0}


def test_stream_disconnect_aborts(client, server):
    before = _aborted(client)
    with httpx.Client(base_url=server["base"], timeout=60) as other:
        with other.stream("POST", "/v1/completions", json={**LONG, "stream": True}) as r:
            data_lines = 0
            for line in r.iter_lines():
                data_lines += line.startswith("data: ")
                if data_lines == 2:
                    break
    _wait_aborted(client, before)


def test_non_stream_disconnect_aborts(client, server):
    before = _aborted(client)
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server["base"] + "/v1/completions", json=LONG, timeout=httpx.Timeout(60, read=1.0))
    _wait_aborted(client, before)


def test_concurrent_requests(client, server):
    expected = _complete(client, max_tokens=5)["choices"][0]["text"]
    results = [None] * 3

    def worker(i):
        with httpx.Client(base_url=server["base"], timeout=120) as c:
            results[i] = c.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 5, "temperature": 0})

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    texts = [r.json()["choices"][0]["text"] for r in results]
    assert all(r.status_code == 200 for r in results)
    assert texts == [expected] * 3  # greedy is batch-invariant enough for 5 tokens
