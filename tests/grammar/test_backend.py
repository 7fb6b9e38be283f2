"""The xgrammar backend over SmolLM2's tokenizer: vocabulary, stop set, errors, cache, and tree masks that
agree with walking each path one token at a time."""
import json

import pytest
import torch

from specpd.core import InvalidRequest
from specpd.grammar.matcher import mask_after, mask_logits, mask_tree_logits

SCHEMA = json.dumps({"type": "object", "properties": {"n": {"type": "integer"}, "s": {"type": "string"}},
                     "required": ["n", "s"]})


def allowed(backend, grammar) -> set[int]:
    logits = torch.zeros(1, backend.vocab_size)
    mask_logits(logits, [grammar])
    return set(torch.isfinite(logits[0]).nonzero().flatten().tolist())


def feed(grammar, tokenizer, text):
    for t in tokenizer.encode(text):
        assert grammar.accept(t), (text, t)


def test_eos_is_allowed_exactly_where_the_grammar_can_end(backend, smollm2):
    tok = smollm2.tokenizer
    g = backend.matcher("json_schema", SCHEMA)
    assert backend.info.stop_token_ids == list(backend.eos_token_ids)
    feed(g, tok, '{"n": 12, "s": "a')
    inside = allowed(backend, g)
    assert not inside & set(backend.eos_token_ids)
    specials = set(tok.all_special_ids) - set(backend.eos_token_ids)
    assert specials and not inside & specials  # <|im_start|> etc. never appear inside a string
    feed(g, tok, '"}')
    assert g.can_end and allowed(backend, g) == set(backend.eos_token_ids)
    assert g.accept(backend.eos_token_ids[0]) and g.terminated


def test_choice_with_quotes_and_unicode_matches_exactly(backend, smollm2):
    choices = ['say "hi"', "back\\slash", "é ü"]
    for c in choices:
        g = backend.matcher("choice", json.dumps(choices))
        feed(g, smollm2.tokenizer, c)
        assert g.can_end
    g = backend.matcher("choice", json.dumps(choices))
    assert not all(g.accept(t) for t in smollm2.tokenizer.encode('say "ho"'))


@pytest.mark.parametrize("kind,spec,needle", [
    ("json_schema", '{"type": "strnig"}', "strnig"),
    ("json_schema", '{"type": "object"', "not valid JSON"),
    ("regex", "[a-", "Unclosed"),
    ("grammar", "root ::= missing", "missing"),
])
def test_a_bad_constraint_is_an_invalid_request_naming_the_field(backend, kind, spec, needle):
    with pytest.raises(InvalidRequest) as err:
        backend.compile(kind, spec, "response_format.json_schema.schema")
    assert err.value.field == "response_format.json_schema.schema"
    assert needle in err.value.message and ".cc:" not in err.value.message
    with pytest.raises(InvalidRequest) as again:  # cached, and named for the asking request's field
        backend.compile(kind, spec, "guided_regex")
    assert again.value.field == "guided_regex"


def test_compiles_are_cached_per_kind_and_spec(backend):
    spec = r"[0-9]{2}-[a-z]{2}"
    backend.compile("regex", spec)
    before = (backend.stats.compiles, backend.stats.compile_cache_hits)
    assert backend.compile("regex", spec) is backend.compile("regex", spec)
    assert (backend.stats.compiles, backend.stats.compile_cache_hits) == (before[0], before[1] + 2)


def test_tree_masks_equal_walking_each_path(backend, smollm2):
    tok = smollm2.tokenizer
    g = backend.matcher("json_schema", SCHEMA)
    feed(g, tok, '{"n": ')
    one, two, x, close = (tok.encode(s)[0] for s in ("1", "2", "x", ","))
    eos = backend.eos_token_ids[0]
    # root -> 1 -> 2 -> ","; root -> 2 -> x (refused) -> 1; root -> x (refused); root -> 1 -> eos (refused)
    tokens = torch.tensor([0, one, two, two, x, close, x, one, eos])
    parents = torch.tensor([-1, 0, 1, 0, 3, 2, 0, 4, 1])
    logits = torch.zeros(len(tokens), backend.vocab_size)
    mask_tree_logits(logits, g, tokens, parents)
    paths = {0: [], 1: [one], 2: [one, two], 3: [two], 5: [one, two, close]}
    want = torch.isfinite(mask_after(g, list(paths.values())))
    for row, (node, path) in enumerate(paths.items()):
        assert torch.equal(torch.isfinite(logits[node]), want[row]), (node, path)
    assert not torch.isfinite(logits[0, x]) and torch.isfinite(logits[0, one])
    assert torch.isfinite(logits[5]).sum() > 0  # after ',' the next key's quote is allowed
    for refused in (4, 6, 7, 8):  # states past a refused token: left unmasked, never committed
        assert torch.isfinite(logits[refused]).all()
    feed(g, tok, "7")  # the walk left the matcher where it was
    assert g.accept(close)
