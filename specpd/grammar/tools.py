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
    try:
        value = json.loads(text)
    except ValueError:
        return None
    calls = [(choice.names[0], value)] if choice.named else [(c["name"], c["parameters"]) for c in value]
    return [{"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
             "function": {"name": name, "arguments": json.dumps(args, ensure_ascii=False)}} for name, args in calls]


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
