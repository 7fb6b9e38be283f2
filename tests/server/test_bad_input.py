"""Bad input, field by field, against the real servers: a unified `specpd serve` and a router in front of a
prefill and a decode server (SmolLM2-135M). Every case, on both endpoints where the field exists, plain and
streaming, is answered with a 4xx whose error names the field; a normal request is answered after each one, and
a client streaming normal requests beside the whole table gets every one of them, unchanged. Pages come back.
"""
import contextlib
import json
import threading
import time

import httpx
import pytest

from specpd.server.launch import free_port
from tests.server.launcher import launch_servers

ENGINE = ["--model", "default", "--max-model-len", "1024", "--kv-cache-memory-mb", "64", "--log-level", "warning"]
USER = [{"role": "user", "content": "Hi"}]
TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}

# (endpoint, what the body changes, the field the error must name); "*" runs on both endpoints
CASES = [
    ("*", {"model": "gpt-nope"}, "model"),
    ("*", {"model": 7}, "model"),
    ("*", {"max_tokens": 0}, "max_tokens"),
    ("*", {"max_tokens": -3}, "max_tokens"),
    ("*", {"max_tokens": 2 ** 70}, "max_tokens"),
    ("*", {"max_tokens": 2.5}, "max_tokens"),
    ("*", {"max_tokens": "many"}, "max_tokens"),
    ("*", {"temperature": -1}, "temperature"),
    ("*", {"temperature": "hot"}, "temperature"),
    ("*", {"top_p": 0}, "top_p"),
    ("*", {"top_p": 1.5}, "top_p"),
    ("*", {"top_k": -7}, "top_k"),
    ("*", {"min_p": 2}, "min_p"),
    ("*", {"n": 0}, "n"),
    ("*", {"n": 1000}, "n"),
    ("*", {"n": 1.5}, "n"),
    ("*", {"stream": [1]}, "stream"),
    ("*", {"stream_options": {"include_usage": True}, "stream": False}, "stream_options"),
    ("*", {"stream_options": 5}, "stream_options"),
    ("*", {"stop": [""]}, "stop"),
    ("*", {"stop": 5}, "stop"),
    ("*", {"stop": [1, 2]}, "stop"),
    ("*", {"seed": 2 ** 64}, "seed"),
    ("*", {"seed": -(2 ** 63) - 1}, "seed"),
    ("*", {"seed": "lucky"}, "seed"),
    ("*", {"frequency_penalty": 3}, "frequency_penalty"),
    ("*", {"presence_penalty": -2.5}, "presence_penalty"),
    ("*", {"repetition_penalty": 0}, "repetition_penalty"),
    ("*", {"logit_bias": {"abc": 1}}, "logit_bias"),
    ("*", {"logit_bias": {"99999999": 1}}, "logit_bias"),
    ("*", {"logit_bias": {"5": 101}}, "logit_bias"),
    ("*", {"logit_bias": {"5": "-Infinity"}}, "logit_bias"),
    ("*", {"logit_bias": [1, 2]}, "logit_bias"),
    ("*", {"stop_token_ids": [-1]}, "stop_token_ids"),
    ("*", {"stop_token_ids": [10 ** 9], "min_tokens": 2}, "stop_token_ids"),
    ("*", {"ignore_eos": [True]}, "ignore_eos"),
    ("*", {"min_tokens": -1}, "min_tokens"),
    ("*", {"min_tokens": 9, "max_tokens": 3}, "min_tokens"),
    ("*", {"skip_special_tokens": {}}, "skip_special_tokens"),
    ("*", {"return_tokens_as_token_ids": []}, "return_tokens_as_token_ids"),
    ("*", {"response_format": {"type": "bogus"}}, "response_format"),
    ("*", {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"$ref": "#/no"}}}},
     "response_format"),
    ("*", {"guided_json": 5}, "guided_json"),
    ("*", {"guided_regex": "(("}, "guided_regex"),
    ("*", {"guided_choice": []}, "guided_choice"),
    ("*", {"guided_grammar": "root ::= ("}, "guided_grammar"),
    ("*", {"structured_outputs": {"regex": 3}}, "structured_outputs"),
    ("*", {"json_schema": "{"}, "json_schema"),
    ("*", {"regex": "[z-a]"}, "regex"),
    ("*", {"ebnf": "root ::= \"a"}, "ebnf"),
    ("*", {"regex": "a+", "ignore_eos": True}, "ignore_eos"),
    ("completions", {"prompt": ""}, "prompt"),
    ("completions", {"prompt": []}, "prompt"),
    ("completions", {"prompt": [-1]}, "prompt"),
    ("completions", {"prompt": [10 ** 9]}, "prompt"),
    ("completions", {"prompt": ["a", "b"]}, "prompt"),
    ("completions", {"prompt": {"text": "hi"}}, "prompt"),
    ("completions", {"prompt": None}, "prompt"),
    ("completions", {"prompt": "x " * 20000}, "prompt"),
    ("completions", {"logprobs": 21}, "logprobs"),
    ("completions", {"logprobs": -1}, "logprobs"),
    ("completions", {"echo": True}, "echo"),
    ("completions", {"best_of": 2}, "best_of"),
    ("completions", {"suffix": "end"}, "suffix"),
    ("chat", {"messages": []}, "messages"),
    ("chat", {"messages": "hello"}, "messages"),
    ("chat", {"messages": None}, "messages"),
    ("chat", {"messages": [{"role": "wizard", "content": "hi"}]}, "messages[0].role"),
    ("chat", {"messages": [{"content": "hi"}]}, "messages[0].role"),
    ("chat", {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
     "messages[0].content"),
    ("chat", {"messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
    ("chat", {"messages": [{"role": "user", "content": "x " * 20000}]}, "messages"),
    ("chat", {"max_completion_tokens": 0}, "max_completion_tokens"),
    ("chat", {"logprobs": "yes please"}, "logprobs"),
    ("chat", {"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ("chat", {"top_logprobs": 2}, "top_logprobs"),
    ("chat", {"tools": 5, "tool_choice": "required"}, "tools"),
    ("chat", {"tools": [TOOL], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ("chat", {"add_generation_prompt": []}, "add_generation_prompt"),
]
RAW = ["{", "[]", "null", "\"text\"", "{\"prompt\": \"a\",}"]  # bodies that are not a JSON object


def _short(value) -> str:
    text = repr(value)
    return text if len(text) <= 120 else text[:117] + "..."


def _cases():
    for endpoint, patch, field in CASES:
        for ep in (("completions", "chat") if endpoint == "*" else (endpoint,)):
            yield ep, patch, field


def _body(endpoint: str, patch: dict, stream: bool) -> dict:
    base = {"prompt": "Hi"} if endpoint == "completions" else {"messages": USER}
    return {**base, "max_tokens": 4, "temperature": 0, "stream": stream, **patch}


def _path(endpoint: str) -> str:
    return "/v1/completions" if endpoint == "completions" else "/v1/chat/completions"


@contextlib.contextmanager
def _unified():
    with launch_servers([ENGINE]) as [(_, base, _)]:
        yield base, [base]


@contextlib.contextmanager
def _router():
    boot = free_port()
    pd = ["--transfer-backend", "tcp", *ENGINE]
    with launch_servers([["--role", "prefill", "--bootstrap-port", str(boot), *pd], ["--role", "decode", *pd]]) as procs:
        p, d = (base for _, base, _ in procs)
        with launch_servers([["--role", "router", "--prefill", p, "--decode", d, "--bootstrap-port", str(boot),
                              "--log-level", "warning"]]) as [(_, router, _)]:
            yield router, [p, d]


class _Neighbour:
    """A client streaming the same normal request over and over while the table runs; it must never fail."""

    def __init__(self, base: str):
        self.base, self.texts, self.errors = base, [], []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self):
        with httpx.Client(base_url=self.base, timeout=120) as client:
            while not self._stop.is_set():
                try:
                    with client.stream("POST", "/v1/completions", json={
                            "prompt": "The capital of France is", "max_tokens": 8, "temperature": 0,
                            "ignore_eos": True, "stream": True}) as r:
                        if r.status_code != 200:
                            self.errors.append(f"{r.status_code}: {r.read()[:200]!r}")
                            continue
                        text = "".join(json.loads(line[6:])["choices"][0]["text"] for line in r.iter_lines()
                                       if line.startswith("data: {") and json.loads(line[6:])["choices"])
                        self.texts.append(text)
                except httpx.HTTPError as e:
                    self.errors.append(repr(e))

    def __enter__(self):
        self._thread.start()
        return self

    def stop(self):
        self._stop.set()
        self._thread.join(timeout=120)

    def __exit__(self, *exc):
        self.stop()


def wait_for_free_pages(base: str, timeout_s: float = 30.0) -> None:
    """Every page of the server at `base` is free again (no request holds one)."""
    deadline = time.monotonic() + timeout_s
    while True:
        info = httpx.get(base + "/server_info", timeout=30).json()
        if info["free_pages"] == info["total_pages"]:
            return
        assert time.monotonic() < deadline, f"{base}: {info['free_pages']} of {info['total_pages']} pages free"
        time.sleep(0.2)


def _refusal(client: httpx.Client, endpoint: str, patch: dict, field: str, stream: bool) -> str | None:
    """None if the case was refused as it must be, else what went wrong."""
    r = client.post(_path(endpoint), json=_body(endpoint, patch, stream))
    if not 400 <= r.status_code < 500:
        return f"status {r.status_code}: {_short(r.text)}"
    error = r.json().get("error", {})
    named = error.get("param") or ""
    if not (named == field or named.startswith(field + ".") or named.startswith(field + "[")):
        return f"error names {named!r}: {_short(error.get('message'))}"
    return None


def _normal(client: httpx.Client, endpoint: str) -> str | None:
    r = client.post(_path(endpoint), json=_body(endpoint, {"max_tokens": 2}, False))
    return None if r.status_code == 200 else f"normal request after it: {r.status_code} {r.text[:200]}"


@pytest.mark.parametrize("target", ["unified", "router"])
def test_every_bad_field_is_refused_and_harms_no_one(target):
    with (_unified() if target == "unified" else _router()) as (base, backends), \
            httpx.Client(base_url=base, timeout=120) as client, _Neighbour(base) as neighbour:
        failures = []
        for endpoint, patch, field in _cases():
            for stream in (False, True):
                if problem := _refusal(client, endpoint, patch, field, stream):
                    failures.append(f"{endpoint} {_short(patch)} stream={stream}: {problem}")
            if problem := _normal(client, endpoint):
                failures.append(f"{endpoint} {_short(patch)}: {problem}")
        for raw in RAW:
            r = client.post("/v1/completions", content=raw, headers={"content-type": "application/json"})
            if r.status_code != 400:
                failures.append(f"body {raw!r}: status {r.status_code}")
        neighbour.stop()
        assert not failures, "\n".join(failures)
        assert not neighbour.errors and len(neighbour.texts) >= 2 and len(set(neighbour.texts)) == 1, (
            neighbour.errors[:3], set(neighbour.texts))
        for backend in backends:
            wait_for_free_pages(backend)
