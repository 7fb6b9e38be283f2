"""Structured outputs under PD (P -> D over ZMQ + tcp transfer, in one process), SmolLM2 + the shipped
EAGLE-3 draft, both draft modes: P samples y0 under the mask, D rebuilds the matcher from the constraint
text and the committed tokens and masks its draft's first round; output and acceptance equal the unified
engine's; a backend mismatch is refused naming both values."""
import json

import pytest

from specpd.config import CacheConfig, EngineConfig, SpecConfig
from specpd.core import SamplingParams
from specpd.disagg.messages import ConfigMismatch, check_compatible
from specpd.engine.llm_engine import LLMEngine
from tests.disagg.handoff_helpers import run_pd

SHORT = {"type": "object", "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer", "maximum": 99}},
         "required": ["ok", "n"]}
PARAMS = [SamplingParams(max_tokens=32, temperature=0.0, constraint_kind="json_schema", constraint_spec=json.dumps(SHORT))]
QUESTIONS = ["Is water wet? Answer in JSON."]


def engine(smollm2, mode, with_draft=True):
    spec = SpecConfig("eagle3", draft_model="default", spec_num_steps=3, spec_topk=1, draft_mode=mode,
                      spec_adaptive_pinned=True)
    return LLMEngine(EngineConfig(model="default", cache=CacheConfig(page_size=16, num_pages=48), spec=spec),
                     checkpoint=smollm2, with_draft=with_draft)


def generate(eng, prompts):
    """Each request alone: the same batches as PD, where D sees each request's handoff on its own."""
    return [eng.generate([p], [params])[0] for p, params in zip(prompts, PARAMS)]


@pytest.fixture(scope="module")
def prompts(smollm2):
    tok = smollm2.tokenizer
    return [tok.encode(tok.apply_chat_template([{"role": "user", "content": q}])) for q in QUESTIONS]


@pytest.fixture(scope="module")
def unified(smollm2, prompts):
    return generate(engine(smollm2, "both"), prompts)


@pytest.mark.parametrize("mode", ["both", "decode-only"])
def test_pd_constrained_output_and_acceptance_equal_unified(smollm2, prompts, unified, mode):
    from specpd.disagg.decode import DecodeWorker
    from specpd.disagg.prefill import PrefillWorker
    p = PrefillWorker(engine(smollm2, mode, with_draft=mode == "both"), "tcp", bootstrap_port=0)
    d = DecodeWorker(engine(smollm2, mode), "tcp")
    try:
        assert p.peer_config.grammar_backend.startswith("xgrammar==")
        got = []
        for i, (prompt, params) in enumerate(zip(prompts, PARAMS)):
            got.append(run_pd(p, d, [prompt], params, room_base=100 * i)["d0"])
        for g, u in zip(got, unified):
            assert g.finish_reason == u.finish_reason == "stop"
            assert g.token_ids == u.token_ids, (g.text, u.text)
            assert (g.spec_verify_count, g.spec_accepted_tokens) == (u.spec_verify_count, u.spec_accepted_tokens)
        json.loads(got[0].text)
        assert sum(g.spec_accepted_tokens for g in got) > 0
        assert p.free_pages == d.free_pages == 48
    finally:
        p.close()
        d.close()


def test_a_grammar_backend_mismatch_is_refused_naming_both(smollm2):
    from specpd.disagg.messages import PeerConfig
    base = dict(model="default", draft_model=None, page_size=16, dtype="float32", spec_algorithm="none")
    with pytest.raises(ConfigMismatch, match="grammar_backend: prefill='xgrammar==0.2.9' decode='xgrammar==0.2.7'"):
        check_compatible(PeerConfig(**base, grammar_backend="xgrammar==0.2.9"),
                         PeerConfig(**base, grammar_backend="xgrammar==0.2.7"))
