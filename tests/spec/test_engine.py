"""Speculative decoding in the unified engine: lossless greedy output, exact replay acceptance, no leaks."""
import pytest

from specpd.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig, SpecConfig
from specpd.core import SamplingParams
from specpd.spec.draft.loader import random_draft_checkpoint
from specpd.engine.llm_engine import LLMEngine
from specpd.model.loader import load_checkpoint
from tests.model.hf_models import save_tiny_model

PROMPTS = [[5, 17, 99, 3], list(range(40, 77)), [7], list(range(100, 113))]
GREEDY = SamplingParams(max_tokens=21, temperature=0.0, ignore_eos=True)
NUM_PAGES = 256


def _target(arch, tmp_path_factory):
    path = tmp_path_factory.mktemp(arch)
    save_tiny_model(arch, path, num_hidden_layers=8)  # EAGLE-3 fuses layers 2, 4, 5
    reference = LLMEngine(EngineConfig(model=str(path), cache=CacheConfig(page_size=4, num_pages=NUM_PAGES)))
    expected = [o.token_ids for o in reference.generate(PROMPTS, GREEDY)]
    return str(path), expected


@pytest.fixture(scope="module", params=["llama", "qwen2", "qwen3"])
def any_target(request, tmp_path_factory):
    return _target(request.param, tmp_path_factory)


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    return _target("llama", tmp_path_factory)


def engine_for(path, spec, page_size=4, chunk=512):
    return LLMEngine(EngineConfig(model=path, cache=CacheConfig(page_size=page_size, num_pages=NUM_PAGES),
                                  scheduler=SchedulerConfig(chunked_prefill_size=chunk), spec=spec))


def run_all(engine, prompts, params, references=None):
    ids = [f"req{i}" for i in range(len(prompts))]
    for i, (rid, prompt) in enumerate(zip(ids, prompts)):
        if references is not None:
            engine.spec_runner.proposer.references[rid] = references[i]
        engine.add_request(rid, prompt, params)
    final = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                final[out.request_id] = out
    assert engine.free_pages == NUM_PAGES
    return [final[rid] for rid in ids]


@pytest.mark.parametrize("algorithm", ["eagle", "eagle3", "mtp"])
@pytest.mark.parametrize("topk,num_tokens", [(1, None), (3, 8)])
def test_draft_families_are_lossless(any_target, tmp_path, algorithm, topk, num_tokens):
    path, expected = any_target
    cfg = ModelConfig.from_hf(load_checkpoint(path).hf_config)
    random_draft_checkpoint(str(tmp_path), algorithm, cfg, seed=1)
    # pinned: a random head's measured costs may rightly keep an unpinned policy at depth 0 throughout
    spec = SpecConfig(algorithm, draft_model=str(tmp_path), spec_num_steps=3, spec_topk=topk,
                      spec_num_draft_tokens=num_tokens, spec_adaptive_pinned=True)
    outs = run_all(engine_for(path, spec, chunk=8), PROMPTS, GREEDY)
    assert [o.token_ids for o in outs] == expected
    assert all(o.spec_verify_count > 0 for o in outs)


@pytest.mark.parametrize("corrupt,steps", [((), 4), ((3,), 4), ((1,), 3), ((5,), 6)])
def test_replay_chain_acceptance_is_exact(target, corrupt, steps):
    path, expected = target
    engine = engine_for(path, SpecConfig("replay", spec_num_steps=steps, spec_adaptive=False))
    engine.spec_runner.proposer.corrupt_depths = set(corrupt)
    outs = run_all(engine, PROMPTS, GREEDY, references=expected)
    assert [o.token_ids for o in outs] == expected
    per_round = min(corrupt, default=steps + 1) - 1  # accepted draft tokens in every full round
    for out in outs:
        remaining = GREEDY.max_tokens - 1  # the first token comes from prefill
        rounds = -(-remaining // (per_round + 1))
        assert out.spec_verify_count == rounds
        assert out.spec_committed_tokens == remaining
    stats = engine.spec_stats
    # every round but each request's last (cut by max_tokens) accepts exactly per_round tokens
    assert stats.accept_length_hist[per_round + 1] >= stats.verify_count - len(PROMPTS)


@pytest.mark.parametrize("rank,num_tokens", [(0, 8), (1, 12), (2, 16)])
def test_replay_tree_places_right_token_at_any_rank(target, rank, num_tokens):
    path, expected = target
    engine = engine_for(path, SpecConfig("replay", spec_num_steps=3, spec_topk=3, spec_adaptive=False,
                                         spec_num_draft_tokens=num_tokens))
    engine.spec_runner.proposer.right_rank = rank
    outs = run_all(engine, PROMPTS, GREEDY, references=expected)
    assert [o.token_ids for o in outs] == expected
    assert all(o.spec_accepted_tokens > 0 for o in outs)
    if rank == 0:  # the right path is the best-scored one: always kept, always fully accepted
        assert all(o.spec_accept_length > 3 for o in outs)


def test_spec_with_page_pressure_and_preemption(target):
    """A pool too small for every request at once: preempted spec requests recompute and stay exact."""
    path, expected = target
    engine = LLMEngine(EngineConfig(model=path, cache=CacheConfig(page_size=4, num_pages=30),
                                    spec=SpecConfig("replay", spec_num_steps=4, spec_adaptive=False)))
    ids = [f"p{i}" for i in range(len(PROMPTS))]
    for rid, prompt, ref in zip(ids, PROMPTS, expected):
        engine.spec_runner.proposer.references[rid] = ref
        engine.add_request(rid, prompt, GREEDY)
    final = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                final[out.request_id] = out
    assert [final[r].token_ids for r in ids] == expected
    assert engine.free_pages == 30


def test_stop_inside_accepted_run_truncates(target):
    path, expected = target
    ref = expected[1]
    stop_tok = ref[7]
    engine = engine_for(path, SpecConfig("replay", spec_num_steps=5, spec_adaptive=False))
    params = SamplingParams(max_tokens=21, temperature=0.0, ignore_eos=True, stop_token_ids=(stop_tok,))
    out = run_all(engine, [PROMPTS[1]], params, references=[ref])[0]
    assert out.token_ids == ref[:ref.index(stop_tok) + 1]
    assert out.finish_reason == "stop"


@pytest.mark.parametrize("max_tokens", [1, 2, 3, 7])
def test_max_tokens_never_exceeded(target, max_tokens):
    path, expected = target
    engine = engine_for(path, SpecConfig("replay", spec_num_steps=4, spec_adaptive=False))
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    outs = run_all(engine, PROMPTS, params, references=expected)
    assert [o.token_ids for o in outs] == [e[:max_tokens] for e in expected]


def test_a_last_prefill_chunk_of_one_token_is_a_prefill(target, tmp_path):
    """A prompt of 2 chunks + 1 token: the last token is prefilled (it samples y0 and makes the first draft
    state), not verified as a decode; output and acceptance are those of one chunk."""
    path, _ = target
    random_draft_checkpoint(str(tmp_path), "eagle", ModelConfig.from_hf(load_checkpoint(path).hf_config), seed=1)
    spec = SpecConfig("eagle", draft_model=str(tmp_path), spec_num_steps=3, spec_adaptive=False)
    prompt = [list(range(60, 77))]
    chunked, whole = [run_all(engine_for(path, spec, chunk=chunk), prompt, GREEDY)[0] for chunk in (8, 512)]
    assert (chunked.token_ids, chunked.spec_verify_count, chunked.spec_accepted_tokens) == \
        (whole.token_ids, whole.spec_verify_count, whole.spec_accepted_tokens)
