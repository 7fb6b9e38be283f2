"""Constraint fields of every dialect -> one (kind, spec); bad shapes are InvalidRequest naming the field."""
import json

import pytest

from specpd.core import InvalidRequest, SamplingParams
from specpd.grammar.constraint import parse_constraint
from specpd.server.protocol import ChatCompletionRequest, CompletionRequest

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}


@pytest.mark.parametrize("fields,kind,spec,field", [
    ({"response_format": {"type": "json_object"}}, "json_object", "", "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA, "strict": True}}},
     "json_schema", json.dumps(SCHEMA), "response_format.json_schema.schema"),
    ({"structured_outputs": {"json": SCHEMA}}, "json_schema", json.dumps(SCHEMA), "structured_outputs.json"),
    ({"structured_outputs": {"regex": "[0-9]+", "disable_any_whitespace": True}}, "regex", "[0-9]+",
     "structured_outputs.regex"),
    ({"structured_outputs": {"choice": ["yes", "no"]}}, "choice", '["yes", "no"]', "structured_outputs.choice"),
    ({"structured_outputs": {"grammar": 'root ::= "a"'}}, "grammar", 'root ::= "a"', "structured_outputs.grammar"),
    ({"structured_outputs": {"json_object": True}}, "json_object", "", "structured_outputs.json_object"),
    ({"guided_json": json.dumps(SCHEMA)}, "json_schema", json.dumps(SCHEMA), "guided_json"),
    ({"guided_regex": "a|b"}, "regex", "a|b", "guided_regex"),
    ({"guided_choice": ["é", "ü"]}, "choice", '["é", "ü"]', "guided_choice"),
    ({"guided_grammar": 'root ::= "a"'}, "grammar", 'root ::= "a"', "guided_grammar"),
    ({"json_schema": json.dumps(SCHEMA)}, "json_schema", json.dumps(SCHEMA), "json_schema"),
    ({"regex": "x+"}, "regex", "x+", "regex"),
    ({"ebnf": 'root ::= "b"'}, "grammar", 'root ::= "b"', "ebnf"),
])
def test_every_dialect_parses_to_one_constraint(fields, kind, spec, field):
    c = parse_constraint(fields)
    assert (c.kind, c.spec, c.field) == (kind, spec, field)


def test_text_format_and_absent_fields_are_no_constraint():
    assert parse_constraint({"response_format": {"type": "text"}}) is None
    assert parse_constraint({"regex": None, "structured_outputs": {"regex": None}}) is None


@pytest.mark.parametrize("fields,field", [
    ({"response_format": {"type": "xml"}}, "response_format.type"),
    ({"response_format": "json"}, "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format.json_schema.schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": [1]}}},
     "response_format.json_schema.schema"),
    ({"guided_json": "{not json"}, "guided_json"),
    ({"guided_choice": []}, "guided_choice"),
    ({"guided_choice": ["a", 3]}, "guided_choice"),
    ({"guided_regex": ""}, "guided_regex"),
    ({"structured_outputs": {"structural_tag": "x"}}, "structured_outputs.structural_tag"),
    ({"structured_outputs": {"json_object": False}}, "structured_outputs.json_object"),
    ({"regex": "a", "guided_json": SCHEMA}, "regex"),  # the later one (in parse order) is named
    ({"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}}, "structured_outputs.regex"),
])
def test_bad_constraints_name_the_field(fields, field):
    with pytest.raises(InvalidRequest) as err:
        parse_constraint(fields)
    assert err.value.field == field


def test_requests_carry_the_constraint_into_sampling_params():
    chat = ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}],
                                 response_format={"type": "json_schema", "json_schema": {"schema": SCHEMA}})
    params = chat.to_sampling_params(default_max_tokens=8)
    assert (params.constraint_kind, params.constraint_spec) == ("json_schema", json.dumps(SCHEMA))
    comp = CompletionRequest(prompt="x", guided_choice=["a", "b"])
    assert comp.to_sampling_params().constraint_kind == "choice"
    assert CompletionRequest(prompt="x").to_sampling_params().constraint_kind is None


def test_ignore_eos_with_a_constraint_is_refused():
    with pytest.raises(InvalidRequest) as err:
        CompletionRequest(prompt="x", regex="a+", ignore_eos=True).to_sampling_params()
    assert err.value.field == "ignore_eos"
    with pytest.raises(InvalidRequest) as err:
        SamplingParams(constraint_kind="yaml", constraint_spec="x").validate()
    assert err.value.field == "constraint_kind"
