"""Structured outputs over HTTP with the shipped EAGLE-3 draft (tree): every dialect on both endpoints,
streaming included, parses and validates; bad constraints are 400s naming the field; the official
`openai` client's response_format / parse round trip works."""
import json
import re

import jsonschema
import pytest

from tests.server.launcher import launch_server
from tests.server.test_server import _sse, _wait_idle

ITEM = {"type": "object", "properties": {
    "item": {"enum": ["apple", "pear", "plum"]},
    "count": {"type": "integer", "minimum": 1, "maximum": 9},
    "tags": {"type": "array", "items": {"type": "string", "pattern": "^[a-z]{2,6}$"}, "maxItems": 2}},
    "required": ["item", "count", "tags"]}
DATE = r"20[0-9]{2}-[01][0-9]-[0-3][0-9]"


@pytest.fixture(scope="module")
def server():
    with launch_server(["--model", "default", "--max-model-len", "1024", "--kv-cache-memory-mb", "64",
                        "--speculative-algorithm", "eagle3", "--draft-model", "default", "--spec-num-steps", "3",
                        "--spec-topk", "4", "--spec-num-draft-tokens", "8", "--spec-adaptive-pinned",
                        "--log-level", "warning"]) as srv:
        yield srv


@pytest.fixture
def client(server):
    yield server["client"]
    _wait_idle(server)


def chat(client, content, **body):
    return client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": content}],
                                                     "max_tokens": 64, "temperature": 0, **body})


def test_chat_json_schema_parses_validates_and_speculates(client):
    fmt = {"type": "json_schema", "json_schema": {"name": "order", "schema": ITEM, "strict": True}}
    r = chat(client, "Order two apples as JSON.", response_format=fmt)
    assert r.status_code == 200, r.text
    body = r.json()
    choice = body["choices"][0]
    assert choice["finish_reason"] == "stop"
    jsonschema.validate(json.loads(choice["message"]["content"]), ITEM)
    assert body["usage"]["spec_verify_count"] >= 1
    metrics = client.get("/metrics").text
    mask_s = re.search(r'^specpd:grammar_mask_seconds_total\{model_name="default"\} (\S+)$', metrics, re.M)
    steps = re.search(r'^specpd:grammar_mask_steps_total\{model_name="default"\} (\S+)$', metrics, re.M)
    assert mask_s and float(mask_s.group(1)) > 0 and steps and float(steps.group(1)) >= 1, metrics[-2000:]
    sampled = chat(client, "Order fruit as JSON.", response_format=fmt, temperature=1.0, seed=3).json()
    jsonschema.validate(json.loads(sampled["choices"][0]["message"]["content"]), ITEM)


def test_chat_json_object_mode(client):
    r = chat(client, 'Reply with the JSON object {"a": 1}.', response_format={"type": "json_object"})
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "stop", choice
    assert isinstance(json.loads(choice["message"]["content"]), dict)


def test_streaming_chat_with_vllm_structured_outputs(client):
    with client.stream("POST", "/v1/chat/completions", json={
            "messages": [{"role": "user", "content": "When did it happen?"}], "max_tokens": 32,
            "temperature": 0, "stream": True, "structured_outputs": {"regex": DATE}}) as r:
        assert r.status_code == 200
        events = _sse(r)
    assert events[-1] == "[DONE]"
    text = "".join(e["choices"][0]["delta"].get("content") or "" for e in events[:-1] if e["choices"])
    assert re.fullmatch(DATE, text), text


@pytest.mark.parametrize("body,check", [
    ({"guided_choice": ["red", "green", "blue"]}, lambda t: t in ("red", "green", "blue")),
    ({"regex": "[A-Z][a-z]{1,8}, [A-Z][a-z]{1,8}"}, lambda t: re.fullmatch("[A-Z][a-z]{1,8}, [A-Z][a-z]{1,8}", t)),
    ({"json_schema": json.dumps(ITEM)}, lambda t: jsonschema.validate(json.loads(t), ITEM) is None),
    ({"ebnf": 'root ::= "x=" [0-9] [0-9]?'}, lambda t: re.fullmatch("x=[0-9]{1,2}", t)),
], ids=["guided_choice", "sglang_regex", "sglang_json_schema", "ebnf"])
def test_completions_dialects(client, body, check):
    r = client.post("/v1/completions", json={"prompt": "The answer:", "max_tokens": 48, "temperature": 0, **body})
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "stop" and check(choice["text"]), choice["text"]


@pytest.mark.parametrize("body,field", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "strnig"}}}},
     "response_format.json_schema.schema"),
    ({"guided_regex": "[0-9"}, "guided_regex"),
    ({"structured_outputs": {"grammar": "root ::= nothing"}}, "structured_outputs.grammar"),
    ({"guided_json": "{bad"}, "guided_json"),
    ({"regex": "a+", "ignore_eos": True}, "ignore_eos"),
    ({"regex": "a+", "guided_choice": ["a"]}, "regex"),
])
def test_bad_constraints_are_400_naming_the_field(client, body, field):
    for path, extra in (("/v1/completions", {"prompt": "x"}),
                        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}]})):
        r = client.post(path, json={"max_tokens": 4, **extra, **body})
        assert r.status_code == 400, r.text
        assert r.json()["error"]["param"] == field, r.text


def test_openai_client_parse_round_trip(server):
    openai = pytest.importorskip("openai")
    from pydantic import BaseModel, Field

    class Fruit(BaseModel):
        name: str = Field(pattern="^[a-z]{3,8}$")
        count: int = Field(ge=1, le=9)

    api = openai.OpenAI(base_url=server["base"] + "/v1", api_key="unused", max_retries=0)
    completion = api.chat.completions.parse(model=server["model"], response_format=Fruit, max_tokens=48,
                                            temperature=0, messages=[{"role": "user", "content": "Three apples."}])
    parsed = completion.choices[0].message.parsed
    assert isinstance(parsed, Fruit) and 1 <= parsed.count <= 9
    _wait_idle(server)


WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city.",
           "parameters": {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]},
                                                           "unit": {"enum": ["C", "F"]}},
                          "required": ["city", "unit"]}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"type": "string", "pattern": "^[A-Z]{3}$"}}, "required": ["zone"]}}}


def test_tool_calls_named_and_required(client):
    named = chat(client, "Weather in Paris?", tools=[WEATHER, TIME],
                 tool_choice={"type": "function", "function": {"name": "get_weather"}}).json()["choices"][0]
    assert named["finish_reason"] == "stop" and named["message"]["content"] is None, named
    [call] = named["message"]["tool_calls"]
    assert call["type"] == "function" and call["function"]["name"] == "get_weather"
    jsonschema.validate(json.loads(call["function"]["arguments"]), WEATHER["function"]["parameters"])
    required = chat(client, "What time is it in Paris?", tools=[WEATHER, TIME], tool_choice="required").json()
    choice = required["choices"][0]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["tool_calls"], choice
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, TIME)}
    for call in choice["message"]["tool_calls"]:
        jsonschema.validate(json.loads(call["function"]["arguments"]), schemas[call["function"]["name"]])


def test_streamed_tool_call_opens_then_streams_its_arguments(client):
    with client.stream("POST", "/v1/chat/completions", json={
            "messages": [{"role": "user", "content": "Weather in Rome?"}], "max_tokens": 48, "temperature": 0,
            "stream": True, "tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "get_weather"}}}) as r:
        events = _sse(r)
    deltas = [e["choices"][0]["delta"] for e in events[:-1] if e["choices"]]
    opening, *fragments = [c for d in deltas for c in d.get("tool_calls", [])]
    assert opening["index"] == 0 and opening["id"].startswith("call_") and opening["type"] == "function"
    assert opening["function"] == {"name": "get_weather", "arguments": ""}
    assert len(fragments) > 2 and all(set(f) == {"index", "function"} and f["index"] == 0 for f in fragments)
    arguments = "".join(f["function"]["arguments"] for f in fragments)  # like OpenAI's, in pieces
    jsonschema.validate(json.loads(arguments), WEATHER["function"]["parameters"])
    assert not any(d.get("content") for d in deltas)
    assert [e["choices"][0]["finish_reason"] for e in events[:-1] if e["choices"]][-1] == "stop"


@pytest.mark.parametrize("body,field", [
    ({"tools": [WEATHER]}, "tool_choice"),  # "auto" (the default with tools)
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice.function.name"),
    ({"tools": [{"type": "function"}], "tool_choice": "required"}, "tools[0]"),
    ({"tools": [WEATHER], "tool_choice": "required", "regex": "a"}, "regex"),
])
def test_bad_tool_requests_are_400(client, body, field):
    r = chat(client, "x", **body)
    assert r.status_code == 400 and r.json()["error"]["param"] == field, r.text


def test_openai_client_forced_tool_call(server):
    openai = pytest.importorskip("openai")
    api = openai.OpenAI(base_url=server["base"] + "/v1", api_key="unused", max_retries=0)
    completion = api.chat.completions.create(model=server["model"], max_tokens=48, temperature=0, tools=[WEATHER],
                                             tool_choice={"type": "function", "function": {"name": "get_weather"}},
                                             messages=[{"role": "user", "content": "Weather in Paris, Celsius?"}])
    call = completion.choices[0].message.tool_calls[0]
    assert call.function.name == "get_weather"
    jsonschema.validate(json.loads(call.function.arguments), WEATHER["function"]["parameters"])
    _wait_idle(server)
