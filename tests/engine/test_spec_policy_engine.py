"""Adaptive speculation in the engine, on a tiny target: lossless, a useless draft goes quiet and stops paying
its extend, a good one speculates deep (the policy on synthetic tables: test_spec_policy.py)."""
import pytest

from specpd.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig, SpecConfig
from specpd.core import SamplingParams
from specpd.draft.loader import random_draft_checkpoint
from specpd.engine.llm_engine import LLMEngine
from specpd.model.loader import load_checkpoint
from tests.model.hf_models import save_tiny_model

PROMPTS = [[5, 17, 99, 3], list(range(40, 77)), [7], list(range(100, 113))]
GREEDY = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
NUM_PAGES = 256


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("llama")
    save_tiny_model("llama", path, num_hidden_layers=8)
    ref = LLMEngine(EngineConfig(model=str(path), cache=CacheConfig(page_size=4, num_pages=NUM_PAGES)))
    return str(path), [o.token_ids for o in ref.generate(PROMPTS, GREEDY)]


def engine(path, spec):
    return LLMEngine(EngineConfig(model=path, cache=CacheConfig(page_size=4, num_pages=NUM_PAGES),
                                  scheduler=SchedulerConfig(chunked_prefill_size=8), spec=spec))


def test_replay_full_acceptance_goes_deep_and_is_lossless(tiny):
    path, expected = tiny
    # a fixed cost table: what is checked is the policy's answer to full acceptance, not this box's timings
    eng = engine(path, SpecConfig("replay", spec_num_steps=4, spec_adaptive_pinned=True))
    for i, ref in enumerate(expected):
        eng.spec_runner.proposer.references[f"offline-x-{i}"] = ref
    ids = [f"offline-x-{i}" for i in range(len(PROMPTS))]
    for rid, p in zip(ids, PROMPTS):
        eng.add_request(rid, p, GREEDY)
    final = {}
    while eng.has_unfinished_requests():
        for out in eng.step():
            if out.finished:
                final[out.request_id] = out
    assert [final[r].token_ids for r in ids] == expected
    assert eng.free_pages == NUM_PAGES
    assert all(final[r].spec_accept_length > 3.5 for r in ids)
    assert eng.spec_runner.policy.stats.rounds_off == 0


def test_useless_draft_stops_speculating_and_stops_paying_the_extend(tiny, tmp_path):
    path, expected = tiny
    random_draft_checkpoint(str(tmp_path), "eagle3", ModelConfig.from_hf(load_checkpoint(path).hf_config), seed=3)
    eng = engine(path, SpecConfig("eagle3", draft_model=str(tmp_path), spec_num_steps=3, spec_adaptive_pinned=True))
    eng.spec_runner.policy.frozen = False  # learn engine-wide that the head is useless
    extend_rows = []
    real_extend = eng.spec_runner.proposer.extend
    eng.spec_runner.proposer.extend = lambda exts: (extend_rows.append(sum(len(e.token_ids) for e in exts)),
                                                    real_extend(exts))[1]
    plain = []  # rounds with every request at depth 0 run as a plain decode step (no trees, batched sampling)
    real_plain = eng.spec_runner._plain_round
    eng.spec_runner._plain_round = lambda *a: (plain.append(1), real_plain(*a))[1]
    shadow = []  # probes in the shadow: the draft caught up, its top-1 against the committed token, no verify row
    real_shadow = eng.spec_runner._observe_shadow
    eng.spec_runner._observe_shadow = lambda req, toks: (shadow.append(req.spec_state.topk_ids[0] == toks[0]),
                                                         real_shadow(req, toks))[1]
    outs = eng.generate(PROMPTS, GREEDY)
    assert [o.token_ids for o in outs] == expected
    assert eng.free_pages == NUM_PAGES
    stats = eng.spec_runner.policy.stats
    assert stats.rounds_off > 0.7 * stats.rounds, stats  # a random head accepts ~nothing
    assert len(plain) > 0.5 * stats.rounds / len(PROMPTS), (len(plain), stats)
    assert shadow and sum(shadow) < 0.5 * len(shadow), shadow  # a random head's top-1 is rarely the token
    # the extend runs for prefill chunks and for probes (catching up), not every round
    assert len(extend_rows) < 0.5 * stats.rounds, (len(extend_rows), stats)
    assert not eng.spec_runner._deferred  # finished requests leave nothing behind


def test_adaptive_eagle_tree_is_lossless(tiny, tmp_path):
    path, expected = tiny
    random_draft_checkpoint(str(tmp_path), "eagle", ModelConfig.from_hf(load_checkpoint(path).hf_config), seed=1)
    eng = engine(path, SpecConfig("eagle", draft_model=str(tmp_path), spec_num_steps=3, spec_topk=2,
                                  spec_num_draft_tokens=6))
    outs = eng.generate(PROMPTS, GREEDY)
    assert [o.token_ids for o in outs] == expected
    assert eng.free_pages == NUM_PAGES
