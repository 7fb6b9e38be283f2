"""Structured-output constraints as requests spell them -> one (kind, spec) pair.

The dialects accepted (one constraint per request; a second one is a 400 naming it):
  - OpenAI `response_format`: {"type": "text"} (none), {"type": "json_object"},
    {"type": "json_schema", "json_schema": {"name": ..., "schema": {...}, "strict": ...}};
  - vLLM `structured_outputs`: {"json": schema, "regex": str, "choice": [str], "grammar": ebnf,
    "json_object": true}, and its older top-level `guided_json` / `guided_regex` / `guided_choice` /
    `guided_grammar`;
  - SGLang's top-level `json_schema` (a JSON string) / `regex` / `ebnf`.

A constraint is plain text: kind in KINDS, spec the schema as JSON text, the regex, the choices as a JSON
list, or the EBNF grammar. That text is what SamplingParams carries (and what crosses the PD wire); the
compiled grammar is built from it on each server (specpd.grammar.backend). No torch, no xgrammar here.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from specpd.core import CONSTRAINT_KINDS, InvalidRequest

KINDS = CONSTRAINT_KINDS  # defined in specpd.core, which validates SamplingParams.constraint_kind against it

# vLLM structured_outputs keys that tune a backend rather than constrain: accepted and ignored
_VLLM_OPTIONS = ("disable_any_whitespace", "disable_additional_properties", "whitespace_pattern",
                 "disable_fallback", "backend")


@dataclass(frozen=True)
class Constraint:
    kind: str  # one of KINDS
    spec: str  # the text the kind compiles from ("" for json_object)
    field: str  # the request field it came from, named in 400s


def parse_constraint(fields: dict[str, Any]) -> Constraint | None:
    """`fields`: the request's constraint fields by name (None = absent). Raises InvalidRequest."""
    found: list[Constraint] = []
    rf = fields.get("response_format")
    if rf is not None:
        found += _response_format(rf)
    so = fields.get("structured_outputs")
    if so is not None:
        found += _structured_outputs(so)
    for name, kind in (("guided_json", "json_schema"), ("guided_regex", "regex"), ("guided_choice", "choice"),
                       ("guided_grammar", "grammar"), ("json_schema", "json_schema"), ("regex", "regex"),
                       ("ebnf", "grammar")):
        value = fields.get(name)
        if value is not None:
            found.append(_make(kind, value, name))
    if len(found) > 1:
        raise InvalidRequest(found[1].field, f"only one structured-output constraint per request; "
                                             f"{found[0].field} is already set")
    return found[0] if found else None


def _response_format(rf: Any) -> list[Constraint]:
    if not isinstance(rf, dict) or not isinstance(rf.get("type"), str):
        raise InvalidRequest("response_format", "must be an object with a string 'type'")
    kind = rf["type"]
    if kind == "text":
        return []
    if kind == "json_object":
        return [Constraint("json_object", "", "response_format")]
    if kind == "json_schema":
        js = rf.get("json_schema")
        if not isinstance(js, dict):
            raise InvalidRequest("response_format.json_schema", "must be an object holding 'schema'")
        if "schema" not in js:
            raise InvalidRequest("response_format.json_schema.schema", "is required")
        return [_make("json_schema", js["schema"], "response_format.json_schema.schema")]
    raise InvalidRequest("response_format.type", f"must be 'text', 'json_object' or 'json_schema', got {kind!r}")


def _structured_outputs(so: Any) -> list[Constraint]:
    if not isinstance(so, dict):
        raise InvalidRequest("structured_outputs", "must be an object")
    out = []
    for key, value in so.items():
        name = f"structured_outputs.{key}"
        if value is None or key in _VLLM_OPTIONS:
            continue
        if key == "json":
            out.append(_make("json_schema", value, name))
        elif key in ("regex", "choice", "grammar"):
            out.append(_make(key, value, name))
        elif key == "json_object":
            if value is not True:
                raise InvalidRequest(name, f"must be true when given, got {value!r}")
            out.append(Constraint("json_object", "", name))
        else:
            raise InvalidRequest(name, "is not supported (supported: json, regex, choice, grammar, json_object)")
    return out


def _make(kind: str, value: Any, field: str) -> Constraint:
    if kind == "json_schema":
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as e:
                raise InvalidRequest(field, f"is not valid JSON: {e}") from None
        if not isinstance(value, (dict, bool)):
            raise InvalidRequest(field, f"must be a JSON schema (an object), got {type(value).__name__}")
        return Constraint(kind, json.dumps(value, ensure_ascii=False), field)
    if kind == "choice":
        if (not isinstance(value, list) or not value
                or not all(isinstance(c, str) and c for c in value)):
            raise InvalidRequest(field, "must be a non-empty list of non-empty strings")
        return Constraint(kind, json.dumps(value, ensure_ascii=False), field)
    if not isinstance(value, str) or not value:
        raise InvalidRequest(field, f"must be a non-empty string, got {value!r}")
    return Constraint(kind, value, field)
