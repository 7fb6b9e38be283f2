"""Adaptive speculation in the engine, on a tiny target: lossless, a useless draft goes quiet and stops paying
its extend, a good one speculates deep (the policy on synthetic tables: test_spec_policy.py)."""
import pytest
import torch

from specpd.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig, SpecConfig
from specpd.core import SamplingParams
from specpd.spec.draft.loader import random_draft_checkpoint
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
    eng = engine(path, SpecConfig("eagle3", draft_model=str(tmp_path), spec_num_steps=3, spec_adaptive_pinned=True,
                                  spec_ngram=False))  # the head alone (the hybrid's n-gram half: below)
    eng.spec_runner.policy.frozen = False  # learn engine-wide that the head is useless
    extend_rows = []
    real_extend = eng.spec_runner.proposer.extend
    eng.spec_runner.proposer.extend = lambda exts: (extend_rows.append(sum(len(e.token_ids) for e in exts)),
                                                    real_extend(exts))[1]
    plain = []  # rounds with every request at depth 0 run as a plain decode step (no trees, batched sampling)
    real_plain = eng.spec_runner._plain_round
    eng.spec_runner._plain_round = lambda *a: (plain.append(1), real_plain(*a))[1]
    shadow = []  # probes in the shadow: the draft caught up, its top-1 against the committed token, no verify row
    real_shadow = eng.spec_runner._observe_shadow  # (a hybrid's free n-gram probes, its draft not caught up, aside)

    def observe_shadow(req, toks, caught_up=True):
        if caught_up:
            shadow.append(req.spec_state.topk_ids[0] == toks[0])
        real_shadow(req, toks, caught_up=caught_up)
    eng.spec_runner._observe_shadow = observe_shadow
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


def test_hybrid_with_a_useless_head_speculates_on_its_ngram_half(tiny, tmp_path):
    """The hybrid (EAGLE-3 + n-grams, the default) with a random head: at depth 0 its n-gram half's guesses probe
    every round for free (SpecRunner._free_guesses), so on text that repeats itself (this tiny model's greedy
    output) it speculates, where probed through its head alone it sat at depth 0; output exact, pages back."""
    path, expected = tiny
    random_draft_checkpoint(str(tmp_path), "eagle3", ModelConfig.from_hf(load_checkpoint(path).hf_config), seed=3)
    eng = engine(path, SpecConfig("eagle3", draft_model=str(tmp_path), spec_num_steps=3, spec_adaptive_pinned=True))
    eng.spec_runner.policy.frozen = False
    free = []
    real_free = eng.spec_runner._free_guesses
    eng.spec_runner._free_guesses = lambda *a: (real_free(*a), free.append(len(eng.spec_runner._free)))[0]
    outs = eng.generate(PROMPTS, GREEDY)
    assert [o.token_ids for o in outs] == expected
    assert eng.free_pages == NUM_PAGES
    stats = eng.spec_runner.policy.stats
    assert sum(free) > 0, free  # requests at depth 0 probed on their n-gram guesses
    assert stats.rounds_off < 0.5 * stats.rounds, stats
    assert not eng.spec_runner._deferred


def test_adaptive_eagle_tree_is_lossless(tiny, tmp_path):
    path, expected = tiny
    random_draft_checkpoint(str(tmp_path), "eagle", ModelConfig.from_hf(load_checkpoint(path).hf_config), seed=1)
    eng = engine(path, SpecConfig("eagle", draft_model=str(tmp_path), spec_num_steps=3, spec_topk=2,
                                  spec_num_draft_tokens=6))
    outs = eng.generate(PROMPTS, GREEDY)
    assert [o.token_ids for o in outs] == expected
    assert eng.free_pages == NUM_PAGES


def _draft_kv(eng, req, n):
    """[layers, 2, n, kv_heads, dim]: the draft's K/V at positions 0..n-1 of a request."""
    pool, ps = eng.spec_runner.proposer.pool, eng.runner.kv_pool.page_size
    pages = torch.tensor([req.pages[p // ps] for p in range(n)])
    offsets = torch.arange(n) % ps
    return torch.stack([torch.stack([pool.k_cache(layer)[pages, offsets], pool.v_cache(layer)[pages, offsets]])
                        for layer in range(pool.num_layers)])


def test_the_prompt_extend_waits_for_the_first_catch_up_and_computes_the_same(tiny, tmp_path):
    """Under the adaptive policy as served (not frozen) a prompt's draft extend, chunk by chunk, waits with the
    request's deferred extends and runs with its first catch-up as one slice: the draft KV over the prompt and
    the first proposal equal what the eager extend (a frozen policy's, after each chunk) computed."""
    path, _ = tiny
    random_draft_checkpoint(str(tmp_path), "eagle3", ModelConfig.from_hf(load_checkpoint(path).hf_config), seed=5)
    spec = SpecConfig("eagle3", draft_model=str(tmp_path), spec_num_steps=3, spec_adaptive_pinned=True,
                      spec_ngram=False)
    eager, lazy = engine(path, spec), engine(path, spec)
    lazy.spec_runner.policy.frozen = False
    prompt = PROMPTS[1]  # 37 tokens: five chunks of 8
    reqs = {}
    for name, eng in (("eager", eager), ("lazy", lazy)):
        reqs[name] = eng.add_request("r", prompt, GREEDY)
        while not reqs[name].output_token_ids:
            eng.step()
    assert reqs["eager"].output_token_ids == reqs["lazy"].output_token_ids
    assert reqs["eager"].draft_kv_len == len(prompt) and lazy.spec_runner._prompt_pending["r"] == len(prompt)
    assert reqs["lazy"].draft_kv_len == 0 and reqs["lazy"].spec_state is None
    with torch.inference_mode():
        lazy.spec_runner._catch_up([reqs["lazy"]])
    assert reqs["lazy"].draft_kv_len == len(prompt) and not lazy.spec_runner._deferred
    torch.testing.assert_close(_draft_kv(lazy, reqs["lazy"], len(prompt)),
                               _draft_kv(eager, reqs["eager"], len(prompt)), rtol=1e-5, atol=1e-5)
    a, b = reqs["eager"].spec_state, reqs["lazy"].spec_state
    assert a.topk_ids == b.topk_ids
    torch.testing.assert_close(torch.tensor(b.topk_probs), torch.tensor(a.topk_probs), rtol=1e-4, atol=1e-6)
    for eng in (eager, lazy):
        eng.abort_request("r")
        eng.step()
        assert eng.free_pages == NUM_PAGES


def test_a_request_that_never_speculates_runs_no_draft_forward_and_the_cache_keeps_its_features(tiny, tmp_path):
    """With every round at depth 0 and no probe, a request runs no draft forward at all: its pages go to the prefix
    cache with the target features of what it deferred (one tensor a page). A request that hits them takes the
    features back as its prompt's deferred extend, and its catch-up builds the draft KV and the first proposal an
    eager extend (a frozen policy's, no cache) computes."""
    path, expected = tiny
    random_draft_checkpoint(str(tmp_path), "eagle3", ModelConfig.from_hf(load_checkpoint(path).hf_config), seed=3)
    spec = SpecConfig("eagle3", draft_model=str(tmp_path), spec_num_steps=3, spec_adaptive_pinned=True,
                      spec_ngram=False)
    eng = engine(path, spec)
    runner, policy = eng.spec_runner, eng.spec_runner.policy
    policy.frozen = False
    real_plan = policy.plan

    def depth_zero(request_ids, *args):
        real_plan(request_ids, *args)
        policy.shadow_probes = []
        return [(0, 1)] * len(request_ids)
    policy.plan = depth_zero
    calls = []
    real_extend = runner.proposer.extend
    runner.proposer.extend = lambda exts: (calls.append([e.request.request_id for e in exts]), real_extend(exts))[1]
    outs = eng.generate(PROMPTS, GREEDY)
    assert [o.token_ids for o in outs] == expected
    assert not calls and not runner._deferred and not runner._prompt_pending
    assert eng.free_pages == NUM_PAGES and eng.prefix_cache.num_cached > 0
    payloads = [n.payload for n in eng.prefix_cache._nodes()]
    assert payloads and all(p is not None and p.shape[0] == 4 for p in payloads)  # no page's draft KV was built

    prompt = PROMPTS[1]  # 37 tokens: 9 pages cached (the token after the 9th is the prompt's last)
    again = eng.add_request("again", prompt, GREEDY)
    while not again.output_token_ids:
        eng.step()
    assert again.num_cached_tokens == 36 and again.draft_kv_len == 0 and not calls
    assert runner._prompt_pending["again"] == len(prompt)  # the cached 36 positions' features, then its own one
    with torch.inference_mode():
        runner._catch_up([again])
    assert again.draft_kv_len == len(prompt) and not runner._deferred
    eager = engine(path, spec)  # frozen: every prompt chunk's draft extend at once
    ref = eager.add_request("again", prompt, GREEDY)
    while not ref.output_token_ids:
        eager.step()
    assert ref.output_token_ids == again.output_token_ids and ref.draft_kv_len == len(prompt)
    torch.testing.assert_close(_draft_kv(eng, again, len(prompt)), _draft_kv(eager, ref, len(prompt)),
                               rtol=1e-5, atol=1e-5)
    assert again.spec_state.topk_ids == ref.spec_state.topk_ids
    # its catch-up built the draft KV of the pages it holds: the cache drops their features when it lets go
    eng.abort_request("again")
    eng.step()
    assert all(n.payload is None for n in eng.prefix_cache._nodes() if n.page in again_pages(eng, prompt))
    assert eng.free_pages == NUM_PAGES


def test_a_cache_hit_takes_the_pages_whose_draft_kv_lags_only_at_its_end(tiny, tmp_path):
    """adopt_cached: the pages before the first with features keep their draft KV; from there every page must
    carry a whole page of features (what one deferred slice rebuilds), so the match is cut at a gap."""
    path, _ = tiny
    random_draft_checkpoint(str(tmp_path), "eagle3", ModelConfig.from_hf(load_checkpoint(path).hf_config), seed=3)
    eng = engine(path, SpecConfig("eagle3", draft_model=str(tmp_path), spec_num_steps=3))
    req = eng.add_request("r", list(range(40, 77)), GREEDY)
    feats = [torch.full((n, 3), float(i)) for i, n in enumerate((2, 4, 4))]
    assert eng.spec_runner.adopt_cached(req, [None, feats[0], feats[1], None, feats[2]]) == 3
    assert req.draft_kv_len == 6 and req.cached_draft[0] == 6
    torch.testing.assert_close(req.cached_draft[1], torch.cat(feats[:2]))
    assert eng.spec_runner.adopt_cached(req, [None, None]) == 2
    assert req.draft_kv_len == 8 and req.cached_draft is None


def again_pages(eng, prompt):
    """The cached pages on `prompt`'s path."""
    return set(eng.prefix_cache.match(prompt, max_tokens=len(prompt) - 1).pages)


def test_an_ngram_request_at_depth_0_shadow_probes_every_round_and_comes_back(tiny):
    """An n-gram server whose past requests found nothing (engine-wide acceptance ~0, as after a chat c32 cell
    that never speculated) and a request whose output repeats: each depth-0 round its n-gram's guess for the next
    token is checked against the token the plain step commits, for free, so the request learns it accepts and
    speculates within its life (with verify-row probes on the probe budget it decoded plainly to the end: a
    grounded n-gram c1 cell at TPOT 11.2 vs plain 9.1 ms). Lossless either way; pages back."""
    path, _ = tiny
    prompt = list(range(200, 212)) * 4  # a tiny random model continues a repeated span: the n-gram matches
    params = SamplingParams(max_tokens=96, temperature=0.0, ignore_eos=True)
    plain = engine(path, SpecConfig()).generate([prompt], params)[0].token_ids
    eng = engine(path, SpecConfig("ngram", spec_adaptive_pinned=True))  # a fixed cost table: no timings read
    policy = eng.spec_runner.policy
    policy.frozen = False  # but the engine-wide learning and the probe budget of a served policy
    assert policy.shadow
    policy.request_rates = [0.02] * policy.num_steps
    policy.cost._spec_scales[1] = 4.0  # a lone request's speculation read 4x its price (the box was busy)
    out = eng.generate([prompt], params)[0]
    assert out.token_ids == plain
    assert policy.stats.probes >= 2  # shadow probes at depth 0, each round its n-gram had a guess
    assert out.spec_verify_count and out.spec_committed_tokens / out.spec_verify_count > 3
    # deterministic here (a pinned cost table, greedy): 26 of 45 rounds at depth 0; with verify-row probes on the
    # budget, 46 of 60 (one probe, then a slow climb)
    assert policy.stats.rounds_off < 36, policy.stats
    assert eng.free_pages == NUM_PAGES


def test_an_ngram_servers_rounds_with_shadow_probes_are_read_by_the_cost_model(tiny):
    """An n-gram drafter's shadow probe is a lookup made before the round: the round costs what a round without
    it costs, so the cost model reads it. (Read as a draft model's catch-up, none was: at b8 some request probes
    every round, the model-free server read no depth-0 round and no speculating one, and its spec_scale stayed at
    its floor while speculating lost; issue 32's n-gram chat c8 / c32 at 0.93x.)"""
    path, _ = tiny
    prompts = [list(range(200, 212)) * 4, list(range(260, 300)), list(range(50, 58)) * 3, [9, 8, 7, 6, 5]]
    params = SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True)
    plain = [o.token_ids for o in engine(path, SpecConfig()).generate(prompts, params)]
    eng = engine(path, SpecConfig("ngram", spec_adaptive_pinned=True))
    policy = eng.spec_runner.policy
    policy.frozen = False
    policy.request_rates = [0.02] * policy.num_steps  # past requests accepted nothing: rounds at depth 0 probe
    probing, read = [], []
    real_plan, real_observe = policy.plan, policy.cost.observe_round

    def plan(*args, **kwargs):
        out = real_plan(*args, **kwargs)
        probing.append(len(policy.shadow_probes))
        return out

    def observe_round(*args, **kwargs):
        read.append(probing[-1])
        return real_observe(*args, **kwargs)

    policy.plan, policy.cost.observe_round = plan, observe_round
    assert [o.token_ids for o in eng.generate(prompts, params)] == plain
    assert any(probing), "no round shadow-probed: the test reads nothing"
    assert any(n > 0 for n in read), (probing, read)
    assert eng.free_pages == NUM_PAGES
