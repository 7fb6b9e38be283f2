"""Forced tool calls: the constraint for a named function / "required", and the OpenAI tool_calls they become,
streamed (an opening delta with id, type and name, then argument fragments) and not, the arguments the same text
either way."""
import json

import pytest

from specpd.core import InvalidRequest
from specpd.grammar.tools import ToolCallStream, tool_calls, tool_constraint

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}}
NAMED = {"type": "function", "function": {"name": "get_weather"}}


def stream(choice, text: str, piece: int) -> tuple[list[dict], dict[int, dict]]:
    """(every delta, per index: the call the deltas add up to), feeding `text` `piece` characters at a time."""
    s = ToolCallStream(choice)
    deltas = [d for i in range(0, len(text), piece) for d in s.feed(text[i:i + piece])]
    calls: dict[int, dict] = {}
    for d in deltas:
        if "id" in d:
            assert d["index"] not in calls and d["type"] == "function" and d["function"]["arguments"] == ""
            calls[d["index"]] = {"id": d["id"], "name": d["function"]["name"], "arguments": ""}
        else:
            assert set(d) == {"index", "function"} and set(d["function"]) == {"arguments"}
            calls[d["index"]]["arguments"] += d["function"]["arguments"]
    return deltas, calls


def test_a_named_call_opens_at_once_and_streams_its_arguments():
    _, choice = tool_constraint([WEATHER, TIME], NAMED)
    text = '{"city": "Rome \\"Eternal\\" {City}"}'
    first = ToolCallStream(choice).feed("")
    assert [d["function"]["name"] for d in first] == ["get_weather"] and first[0]["function"]["arguments"] == ""
    deltas, calls = stream(choice, text, 3)
    assert len(deltas) > 3 and calls[0]["name"] == "get_weather" and calls[0]["arguments"] == text
    [whole] = tool_calls(text, choice)
    assert whole["function"] == {"name": "get_weather", "arguments": text}


@pytest.mark.parametrize("piece", [1, 4, 1000])
def test_required_calls_stream_one_by_one_in_any_key_order(piece):
    _, choice = tool_constraint([WEATHER, TIME], "required")
    args = ['{"city": "a\\"]}, {\\\\"}', '{"x": [1, {"y": null}]}']
    text = (f'[{{"name": "get_weather", "parameters": {args[0]}}}, '
            f'{{"parameters": {args[1]}, "name": "get_time"}}]')
    json.loads(text)
    deltas, calls = stream(choice, text, piece)
    assert [(c["name"], c["arguments"]) for c in calls.values()] == [("get_weather", args[0]), ("get_time", args[1])]
    assert [json.loads(c["arguments"]) for c in calls.values()] == [json.loads(a) for a in args]
    if piece == 1:  # the first call opens before the second exists, and its arguments come in fragments
        opened = [i for i, d in enumerate(deltas) if "id" in d]
        assert len(opened) == 2 and sum(1 for d in deltas[:opened[1]] if d["index"] == 0) > 2
    whole = tool_calls(text, choice)
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in whole] == \
        [(c["name"], c["arguments"]) for c in calls.values()]


def test_an_unfinished_call_is_no_tool_calls():
    _, choice = tool_constraint([WEATHER], "required")
    assert tool_calls('[{"name": "get_weather", "parameters": {"ci', choice) is None


def test_auto_is_refused():
    with pytest.raises(InvalidRequest) as err:
        tool_constraint([WEATHER], "auto")
    assert err.value.field == "tool_choice"
