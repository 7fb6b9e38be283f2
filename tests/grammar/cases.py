"""The constrained requests the engine, PD and cluster tests share (one reference run serves them all)."""
import json
import re

import jsonschema

from specpd.core import SamplingParams

NUM_PAGES = 96
PERSON = {"type": "object", "properties": {  # nested object, array, enum, bounded integers, a string pattern
    "city": {"enum": ["Paris", "London", "Tokyo"]},
    "address": {"type": "object", "properties": {"zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                "required": ["zip"]},
    "scores": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 100}, "maxItems": 2}},
    "required": ["city", "address", "scores"]}
SHORT = {"type": "object", "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer", "maximum": 99}},
         "required": ["ok", "n"]}
PHONE = r"[0-9]{3}-[0-9]{4}"
CHOICES = ["yes", "no", "maybe"]


def schema_params(schema, **kw):
    return SamplingParams(max_tokens=64, constraint_kind="json_schema", constraint_spec=json.dumps(schema), **kw)


# (question, params, check) -- greedy rows are compared token for token across engines
CASES = [
    ("Describe Alice from Paris, as JSON.", schema_params(PERSON, temperature=0.0), ("json", PERSON)),
    ("Give a phone number.", SamplingParams(max_tokens=16, temperature=0.0, constraint_kind="regex",
                                            constraint_spec=PHONE), ("regex", PHONE)),
    ("Is the sky blue?", SamplingParams(max_tokens=8, temperature=0.0, constraint_kind="choice",
                                        constraint_spec=json.dumps(CHOICES)), ("choice", CHOICES)),
    ("Is water wet? Answer in JSON.", schema_params(SHORT, temperature=1.0, seed=7), ("json", SHORT)),
    # text to copy, laid out unlike the grammar's compact JSON: n-gram candidates the grammar refuses
    ("Copy this JSON exactly:\n{\n  \"city\": \"Tokyo\",\n  \"address\": {\n    \"zip\": \"10115\"\n  },\n"
     "  \"scores\": [12, 85]\n}", schema_params(PERSON, temperature=0.0), ("json", PERSON)),
]
COPY = len(CASES) - 1


def check(text, how):
    kind, want = how
    if kind == "json":
        jsonschema.validate(json.loads(text), want)
    elif kind == "regex":
        assert re.fullmatch(want, text), text
    else:
        assert text in want
