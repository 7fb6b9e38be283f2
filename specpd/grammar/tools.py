"""Tool calls as a structured-output constraint (chat completions).

1. `tool_constraint(tools, tool_choice)` checks OpenAI's `tools` / `tool_choice` and returns the constraint:
   - a named function (`{"type": "function", "function": {"name": N}}`): the output is N's arguments, a
     JSON object valid against N's `parameters` schema;
   - "required": the output is a JSON array of one or more `{"name": ..., "parameters": {...}}` calls,
     each valid against its function's schema (vLLM's form for "required");
   - "none" (or no tools): no constraint; "auto": a 400 -- choosing between text and a call needs the
     model's own tool format, which this engine does not parse.
2. `tool_calls(text, choice)` turns the finished output into OpenAI `tool_calls` entries (None when the
   output did not complete, e.g. it hit max_tokens: the response then carries the text as content).
3. `ToolCallStream` turns the output, as it streams, into OpenAI's tool_calls deltas: an opening delta per
   call (index, id, type, name), then its arguments in fragments. Streamed or not, a call's arguments are
   the output's own text of them.
No torch, no xgrammar here.
"""
from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from typing import Any

from specpd.core import InvalidRequest
from specpd.grammar.constraint import Constraint


@dataclass(frozen=True)
class ToolChoice:
    names: tuple[str, ...]  # the functions the output may call
    named: bool  # one named function: the output is its arguments alone


def tool_constraint(tools: Any, tool_choice: Any) -> tuple[Constraint, ToolChoice] | None:
    if tools is None or tool_choice == "none":
        return None
    functions = _functions(tools)
    if tool_choice is None or tool_choice == "auto":
        raise InvalidRequest("tool_choice", '"auto" is not supported (this server does not parse the model\'s '
                                            'own tool-call format); send "required" or a named function')
    if tool_choice == "required":
        calls = [{"type": "object", "properties": {"name": {"enum": [name]}, "parameters": schema},
                  "required": ["name", "parameters"]} for name, schema in functions.items()]
        schema = {"type": "array", "minItems": 1, "items": calls[0] if len(calls) == 1 else {"anyOf": calls}}
        return (Constraint("json_schema", json.dumps(schema, ensure_ascii=False), "tools"),
                ToolChoice(tuple(functions), named=False))
    name = tool_choice.get("function", {}).get("name") if isinstance(tool_choice, dict) else None
    if not isinstance(tool_choice, dict) or tool_choice.get("type") != "function" or not isinstance(name, str):
        raise InvalidRequest("tool_choice", 'must be "none", "required" or {"type": "function", "function": '
                                            f'{{"name": ...}}}}, got {tool_choice!r}')
    if name not in functions:
        raise InvalidRequest("tool_choice.function.name", f"{name!r} is not one of the tools "
                                                          f"({', '.join(functions)})")
    return (Constraint("json_schema", json.dumps(functions[name], ensure_ascii=False), "tools"),
            ToolChoice((name,), named=True))


def tool_calls(text: str, choice: ToolChoice) -> list[dict[str, Any]] | None:
    """The finished output's calls, each call's arguments the output's own text of them (what streaming
    sends), or None when the output is not a complete call."""
    try:
        json.loads(text)
    except ValueError:
        return None
    stream = ToolCallStream(choice)
    stream.feed(text)
    return [{"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
            for c in stream.calls]


@dataclass
class _Call:
    id: str
    name: str | None = None
    arguments: str = ""
    sent: int = -1  # characters of `arguments` streamed; -1: the opening delta (id, name) not sent yet


class ToolCallStream:
    """A forced tool call's output, as it streams, -> OpenAI `tool_calls` deltas: per call, one delta with
    index, id, type and name (arguments ""), then argument fragments as the text arrives.

    A named function's output is its arguments, so its opening delta goes out at once. "required" outputs a
    JSON array of {"name": ..., "parameters": ...}: a character scanner (strings, escapes, nesting) reads
    each element's keys and values; a call opens once its name is complete, and its arguments are the text
    of its parameters value so far (seen before the name, in another key order, they wait for it)."""

    def __init__(self, choice: ToolChoice):
        self.named = choice.named
        self.calls: list[_Call] = [_Call(_call_id(), choice.names[0])] if choice.named else []
        self._text = ""  # "required": the output so far, scanned up to _pos
        self._pos = 0
        self._depth = 0  # brackets open outside strings; a call's keys are at depth 2
        self._in_string = self._escape = False
        self._expect = "key"  # at depth 2: key | colon | value | comma
        self._key: str | None = None  # the key whose value is being read
        self._reading: str | None = None  # at depth 2: key | string | nested | primitive
        self._start = 0  # where the key or value being read began in _text

    def feed(self, text: str) -> list[dict[str, Any]]:
        """The deltas for the next piece of output (possibly none)."""
        if self.named:
            self.calls[0].arguments += text
        else:
            self._text += text
            for self._pos in range(self._pos, len(self._text)):
                self._scan(self._text[self._pos], self._pos)
            self._pos = len(self._text)
            if self._reading not in (None, "key") and self._key == "parameters":
                self.calls[-1].arguments = self._text[self._start:]
        deltas = []
        for index, call in enumerate(self.calls):
            if call.name is None:
                continue
            if call.sent < 0:
                deltas.append({"index": index, "id": call.id, "type": "function",
                               "function": {"name": call.name, "arguments": ""}})
                call.sent = 0
            if len(call.arguments) > call.sent:
                deltas.append({"index": index, "function": {"arguments": call.arguments[call.sent:]}})
                call.sent = len(call.arguments)
        return deltas

    def _scan(self, ch: str, i: int) -> None:
        if self._in_string:
            if self._escape:
                self._escape = False
            elif ch == "\\":
                self._escape = True
            elif ch == '"':
                self._in_string = False
                if self._reading in ("key", "string") and self._depth == 2:
                    self._finish(i + 1)
            return
        if self._reading == "primitive" and (ch in ",}" or ch.isspace()):
            self._finish(i)
        if ch == '"':
            self._in_string = True
            if self._depth == 2 and self._expect in ("key", "value"):
                self._begin("key" if self._expect == "key" else "string", i)
        elif ch in "[{":
            if self._depth == 2 and self._expect == "value":
                self._begin("nested", i)
            self._depth += 1
            if self._depth == 2:  # the next call
                self.calls.append(_Call(_call_id()))
                self._expect = "key"
        elif ch in "]}":
            self._depth -= 1
            if self._depth == 2 and self._reading == "nested":
                self._finish(i + 1)
        elif self._depth == 2:
            if ch == ":" and self._expect == "colon":
                self._expect = "value"
            elif ch == ",":
                self._expect = "key"
            elif not ch.isspace() and self._expect == "value":
                self._begin("primitive", i)

    def _begin(self, kind: str, i: int) -> None:
        self._reading, self._start = kind, i

    def _finish(self, end: int) -> None:
        raw = self._text[self._start:end]
        if self._reading == "key":
            self._key, self._expect = json.loads(raw), "colon"
        else:
            call = self.calls[-1]
            if self._key == "name":
                call.name = json.loads(raw)
            elif self._key == "parameters":
                call.arguments = raw
            self._expect = "comma"
        self._reading = None


def _call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def _functions(tools: Any) -> dict[str, Any]:
    """name -> parameters schema, in the request's order."""
    if not isinstance(tools, list) or not tools:
        raise InvalidRequest("tools", "must be a non-empty list of {\"type\": \"function\", \"function\": {...}}")
    functions: dict[str, Any] = {}
    for i, tool in enumerate(tools):
        fn = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(fn, dict) \
                or not isinstance(fn.get("name"), str) or not fn["name"]:
            raise InvalidRequest(f"tools[{i}]", 'must be {"type": "function", "function": {"name": ..., '
                                                '"parameters": {...}}}')
        params = fn.get("parameters", {"type": "object"})
        if not isinstance(params, dict):
            raise InvalidRequest(f"tools[{i}].function.parameters", "must be a JSON schema object")
        functions[fn["name"]] = params
    return functions
