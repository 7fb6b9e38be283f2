"""PD handoff in one process: engine hooks, then PrefillWorker -> DecodeWorker over real ZMQ + TCP transfer.

Greedy output after the handoff equals the unified engine's, and both pools return to their free counts.
(Refused rooms, dead or mismatched prefill servers, timeouts: test_handoff_failures.py.)
"""
import pytest
import torch

from specpd.config import ModelConfig, SpecConfig
from specpd.core import SamplingParams, TokenLogprob
from specpd.disagg.messages import KVDestination
from specpd.model.loader import load_checkpoint
from tests.disagg.handoff_helpers import (FIRST_LOGPROB, GREEDY, PROMPTS, make_engine, make_workers,  # noqa: F401
                                          model_dir, run_pd, run_unified)
from tests.model.hf_models import save_tiny_model


@pytest.fixture(scope="module")
def spec_model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_llama_8l")
    save_tiny_model("llama", path, num_hidden_layers=8)  # EAGLE-3 fuses layers 2, 4, 5
    return str(path)


def test_engine_hooks_copy_pages(model_dir):
    unified = make_engine(model_dir)
    expected = [o.token_ids for o in unified.generate(PROMPTS, GREEDY)]
    p, d = make_engine(model_dir), make_engine(model_dir)
    for i, prompt in enumerate(PROMPTS):
        p.add_request(f"p{i}", prompt, GREEDY, prefill_only=True)
    handoffs = {}
    while p.has_unfinished_requests():
        for out in p.step():
            assert out.finished and out.finish_reason == "handoff"
            handoffs[out.request_id] = out.token_ids[0]
    for i, prompt in enumerate(PROMPTS):
        req = p.take_handoff(f"p{i}")
        dst = d.scheduler.allocator.alloc(-(-len(prompt) // 4))
        d.runner.kv_pool.buffer[dst] = p.runner.kv_pool.buffer[req.pages[:len(dst)]]
        p.release_handoff(f"p{i}")
        d.add_prebuilt_request(f"d{i}", prompt, GREEDY, dst, handoffs[f"p{i}"], None)
    assert p.free_pages == 64
    final = {}
    while d.has_unfinished_requests():
        for out in d.step():
            if out.finished:
                final[out.request_id] = out.token_ids
    assert [final[f"d{i}"] for i in range(len(PROMPTS))] == expected
    assert d.free_pages == 64


def test_handoff_token_can_finish_the_request(model_dir):
    d = make_engine(model_dir)
    pages = d.scheduler.allocator.alloc(2)
    d.add_prebuilt_request("r", [1, 2, 3, 4, 5], SamplingParams(max_tokens=1, temperature=0.0), pages, 42,
                           TokenLogprob(42, -0.5))
    outs = d.step()
    assert outs[0].finished and outs[0].token_ids == [42] and outs[0].finish_reason == "length"
    assert d.free_pages == 64


@pytest.mark.parametrize("backend", ["tcp", "mooncake"])
def test_workers_over_zmq(model_dir, backend):
    from specpd.disagg.decode import DecodeWorker
    from specpd.disagg.prefill import PrefillWorker
    from specpd.disagg.transfer import backend_available
    ok, why = backend_available(backend)
    if not ok:
        pytest.skip(why)
    expected = [o.token_ids for o in make_engine(model_dir).generate(PROMPTS, GREEDY)]
    p = PrefillWorker(make_engine(model_dir), backend, bootstrap_port=0)  # 0: the OS picks (free_port raced)
    d = DecodeWorker(make_engine(model_dir), backend)
    try:
        final = run_pd(p, d, PROMPTS, GREEDY)
        assert [final[f"d{i}"].token_ids for i in range(len(PROMPTS))] == expected
        assert p.free_pages == 64 and d.free_pages == 64
    finally:
        p.close()
        d.close()


def record_trees(engine) -> dict:
    """Every draft tree the engine's proposer builds, by prompt: {prompt: [[tokens], [probs]] per round}."""
    proposer = engine.spec_runner.proposer
    trees, propose = {}, proposer.propose

    def recording(requests, starts, *rest):  # rest: the adaptive policy's per-request plans, if any
        out = propose(requests, starts, *rest)
        for req, tree in zip(requests, out):
            trees.setdefault(tuple(req.prompt_token_ids), []).append(
                (tree.tokens.tolist(), tree.cum_logprob.float()))
        return out

    proposer.propose = recording
    return trees


@pytest.mark.parametrize("mode", ["both", "decode-only"])
@pytest.mark.parametrize("algorithm,topk,num_tokens", [("eagle", 1, None), ("eagle3", 3, 8), ("mtp", 1, None)])
def test_draft_modes_keep_acceptance(spec_model_dir, tmp_path, algorithm, topk, num_tokens, mode):
    """Draft-on-both: P's draft KV (draft pool pages) and first-round proposal travel. Draft-on-decode-only:
    P (no draft loaded) sends the prompt's target features and D runs the draft extend. Either way the output
    AND the acceptance equal the unified engine's, proposal by proposal."""
    from specpd.spec.draft.loader import random_draft_checkpoint
    cfg = ModelConfig.from_hf(load_checkpoint(spec_model_dir).hf_config)
    random_draft_checkpoint(str(tmp_path), algorithm, cfg, seed=1)
    spec = SpecConfig(algorithm, draft_model=str(tmp_path), spec_num_steps=3, spec_topk=topk,
                      spec_num_draft_tokens=num_tokens, draft_mode=mode, spec_adaptive=False,
                      spec_ngram=False)  # the head's own proposals (hybrid under PD: test_pd_spec_policy)
    unified = make_engine(spec_model_dir, spec=spec)
    want_trees = record_trees(unified)
    expected = unified.generate(PROMPTS, GREEDY)
    p, d = make_workers(spec_model_dir, spec)
    got_trees = record_trees(d.engine)
    try:
        # the draft's layers sit in the target's pages, after the target's block: one pool, one descriptor per page
        assert d.engine.spec_runner.proposer.pool.parent is d.engine.runner.kv_pool
        assert len(p.backend.layouts) == len(d.backend.layouts) == 1
        d_page = d.backend.layouts[0].page_bytes
        if mode == "both":  # the whole page moves
            assert p.peer_config.draft_mode == "both" and p.backend.layouts[0].page_bytes == d_page
        else:  # P has no draft: its target-only pages fill the target's block of D's pages, D builds the draft KV
            assert p.peer_config.draft_mode == "decode-only" and p.engine.spec_runner is None
            assert p.backend.layouts[0].page_bytes < d_page
        assert sum(len(runs) for runs in p.kv.plan(KVDestination(0, tuple(d.kv.endpoints), [])).values()) == 1
        final = run_pd(p, d, PROMPTS, GREEDY)
        got = [final[f"d{i}"] for i in range(len(PROMPTS))]
        assert [o.token_ids for o in got] == [o.token_ids for o in expected]
        assert [(o.spec_verify_count, o.spec_accepted_tokens) for o in got] == \
               [(o.spec_verify_count, o.spec_accepted_tokens) for o in expected]
        # a random draft accepts ~nothing, so compare every proposal: depth 1 comes from the first-round
        # top-k, deeper nodes from the prompt's draft KV and hidden; a junk first round or missing KV changes them
        assert {k: [t for t, _ in v] for k, v in got_trees.items()} == {k: [t for t, _ in v] for k, v in want_trees.items()}
        for prompt, rounds in want_trees.items():  # batch composition differs: fp32 noise only
            for (_, want_lp), (_, got_lp) in zip(rounds, got_trees[prompt]):
                assert torch.allclose(got_lp, want_lp, atol=1e-3), (prompt, got_lp, want_lp)
        assert p.free_pages == 64 and d.free_pages == 64
    finally:
        p.close()
        d.close()


@pytest.mark.parametrize("mode", [None, "both", "decode-only"])
def test_seeded_sampling_and_top_logprobs_match_unified(spec_model_dir, tmp_path, mode):
    """D's request generator continues from P's state after y0: seeded sampling gives the unified tokens;
    y0's top logprobs travel in the record."""
    from specpd.spec.draft.loader import random_draft_checkpoint
    spec = None
    if mode is not None:
        random_draft_checkpoint(str(tmp_path), "eagle", ModelConfig.from_hf(load_checkpoint(spec_model_dir).hf_config),
                                seed=1)
        spec = SpecConfig("eagle", draft_model=str(tmp_path), spec_num_steps=3, draft_mode=mode, spec_adaptive=False)
    params = SamplingParams(max_tokens=10, temperature=1.0, top_p=0.9, seed=11, ignore_eos=True, logprobs=3)
    FIRST_LOGPROB.clear()
    expected = run_unified(make_engine(spec_model_dir, spec=spec), PROMPTS, params)
    p, d = make_workers(spec_model_dir, spec)
    try:
        final = run_pd(p, d, PROMPTS, params)
        got = [final[f"d{i}"] for i in range(len(PROMPTS))]
        assert [o.token_ids for o in got] == [o.token_ids for o in expected]
        assert len({tuple(o.token_ids) for o in got}) == len(PROMPTS)
        for i in range(len(PROMPTS)):
            g, e = FIRST_LOGPROB[f"d{i}"], FIRST_LOGPROB[f"u{i}"]
            assert len(g.top) == 3 and [t for t, _ in g.top] == [t for t, _ in e.top]
            assert g.logprob == pytest.approx(e.logprob, abs=1e-5)
        assert p.free_pages == 64 and d.free_pages == 64
    finally:
        p.close()
        d.close()


def record_plans(engine, cost) -> list:
    """Every round's plan of the engine's adaptive policy, priced by `cost` (one table for every engine: the
    startup measurement is the one input that differs from run to run), as (steps, probed) per request."""
    policy = engine.spec_runner.policy
    policy.cost = cost
    rounds, plan = [], policy.plan

    def recording(request_ids, *args, **kwargs):
        out = plan(request_ids, *args, **kwargs)
        rounds.append([(steps, rid in policy.shadow_probes) for rid, (steps, _) in zip(request_ids, out)])
        return out
    policy.plan = recording
    return rounds


@pytest.mark.parametrize("mode", ["both", "decode-only"])
def test_a_committed_handoff_plans_the_unified_engines_rounds_with_the_policy_as_served(spec_model_dir, tmp_path,
                                                                                          mode):
    """The adaptive policy NOT pinned (engine-wide learning), requests one at a time as a client sends them, one
    cost table for both sides: D plans every round of every request exactly as the unified engine does. A
    committed handoff starts with the draft state (both: P's, decode-only: D's own extend) and the policy state the
    unified engine's request has after its prefill: nothing deferred, its first-round top-k (issue 31 asked whether
    it did; this is the check). Here every request speculates from its first round (the prior is the per-request
    average, ~0.4 for this draft). One that starts at depth 0 does not probe alike: D's draft is in step after a
    draft-on-both handoff (a free probe in its first round), the unified engine's prompt extend is deferred (its
    probe waits for its interval); outputs are the same either way."""
    from specpd.spec.draft.loader import random_draft_checkpoint
    from specpd.spec.cost import CostModel
    random_draft_checkpoint(str(tmp_path), "eagle3", ModelConfig.from_hf(load_checkpoint(spec_model_dir).hf_config),
                            seed=2)
    # the shipped shape: the head's tree with n-grams merged in (the tiny model's loops feed them)
    spec = SpecConfig("eagle3", draft_model=str(tmp_path), draft_mode=mode, spec_ngram_min_match=1)
    prompts = [[5, 17, 99, 3, 5, 17, 99, 3, 8], list(range(40, 61)) * 2, list(range(1, 33)), [7, 7, 1]]
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    cost = CostModel({1: 0.050, 2: 0.051, 4: 0.052, 8: 0.06, 64: 0.113}, 0.0005, {1: 0.003, 64: 0.010},
                     frozen=True)  # no online refinement: the one input a box's timing would move
    unified = make_engine(spec_model_dir, spec=spec)
    assert not unified.spec_runner.policy.frozen
    want_rounds = record_plans(unified, cost)
    want = [unified.generate([prompt], params)[0] for prompt in prompts]
    p, d = make_workers(spec_model_dir, spec)
    got_rounds = record_plans(d.engine, cost)
    try:
        got = [run_pd(p, d, [prompt], params, room_base=2000 + 10 * i)["d0"] for i, prompt in enumerate(prompts)]
        assert [o.token_ids for o in got] == [o.token_ids for o in want]
        assert got_rounds == want_rounds
        assert [(o.spec_verify_count, o.spec_accepted_tokens) for o in got] == \
               [(o.spec_verify_count, o.spec_accepted_tokens) for o in want]
        assert d.engine.spec_runner.policy.global_accept == unified.spec_runner.policy.global_accept
        assert any(steps for r in want_rounds for steps, _ in r)  # it speculated
        assert p.free_pages == 64 and d.free_pages == 64
    finally:
        p.close()
        d.close()


def test_a_decode_only_handoffs_prompt_extend_waits_as_a_colocated_prompts(spec_model_dir, tmp_path):
    """Draft-on-decode-only under the adaptive policy as served: the draft extend over the prompt's target
    features waits at commit as a colocated prefill's does (SpecRunner.defer_prompt), and the first catch-up
    computes the draft KV and proposal a frozen policy's eager extend at commit does."""
    from specpd.spec.draft.loader import random_draft_checkpoint
    cfg = ModelConfig.from_hf(load_checkpoint(spec_model_dir).hf_config)
    random_draft_checkpoint(str(tmp_path), "eagle3", cfg, seed=4)
    spec = SpecConfig("eagle3", draft_model=str(tmp_path), draft_mode="decode-only", spec_adaptive_pinned=True,
                      spec_ngram=False)
    eager, lazy = make_engine(spec_model_dir, spec=spec), make_engine(spec_model_dir, spec=spec)
    lazy.spec_runner.policy.frozen = False
    prompt = list(range(40, 61))
    features = torch.randn(len(prompt), 3 * cfg.hidden_size, generator=torch.Generator().manual_seed(0))
    calls = []
    real_extend = lazy.spec_runner.proposer.extend
    lazy.spec_runner.proposer.extend = lambda exts: (calls.append(len(exts)), real_extend(exts))[1]
    reqs = {}
    for name, eng in (("eager", eager), ("lazy", lazy)):
        pages = eng.scheduler.allocator.alloc(-(-len(prompt) // 4))
        reqs[name] = eng.add_prebuilt_request("r", prompt, GREEDY, pages, 7, None, target_hidden=features)
    assert reqs["eager"].draft_kv_len == len(prompt) and reqs["eager"].spec_state is not None
    assert not calls and reqs["lazy"].draft_kv_len == 0 and lazy.spec_runner._prompt_pending["r"] == len(prompt)
    with torch.inference_mode():
        lazy.spec_runner._catch_up([reqs["lazy"]])
    assert calls == [1] and reqs["lazy"].draft_kv_len == len(prompt)
    a, b = reqs["eager"], reqs["lazy"]
    for layer in range(eager.spec_runner.proposer.pool.num_layers):
        for cache in ("k_cache", "v_cache"):
            torch.testing.assert_close(getattr(lazy.spec_runner.proposer.pool, cache)(layer)[b.pages],
                                       getattr(eager.spec_runner.proposer.pool, cache)(layer)[a.pages])
    assert a.spec_state.topk_ids == b.spec_state.topk_ids
    for eng in (eager, lazy):
        eng.abort_request("r")
        while eng.has_unfinished_requests():
            eng.step()
        assert eng.free_pages == 64
