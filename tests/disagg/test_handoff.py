"""PD handoff in one process: engine hooks, then PrefillWorker -> DecodeWorker over real ZMQ + TCP transfer.

Greedy output after the handoff equals the unified engine's, and both pools return to their free counts.
"""
import time

import pytest
import torch

from specpd.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig, SpecConfig
from specpd.core import SamplingParams, TokenLogprob
from specpd.disagg.transfer import backend_available
from specpd.engine.llm_engine import LLMEngine
from specpd.model.loader import load_checkpoint
from tests.model.hf_models import save_tiny_model

PROMPTS = [[5, 17, 99, 3, 8], list(range(40, 61)), [7], list(range(1, 33))]  # 32: a page-aligned prompt
GREEDY = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_llama")
    save_tiny_model("llama", path)
    return str(path)


@pytest.fixture(scope="module")
def spec_model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_llama_8l")
    save_tiny_model("llama", path, num_hidden_layers=8)  # EAGLE-3 fuses layers 2, 4, 5
    return str(path)


def make_engine(model_dir, page_size=4, spec=None, with_draft=True):
    return LLMEngine(EngineConfig(model=model_dir, cache=CacheConfig(page_size=page_size, num_pages=64),
                                  scheduler=SchedulerConfig(chunked_prefill_size=8), spec=spec or SpecConfig()),
                     with_draft=with_draft)


def make_workers(model_dir, spec=None, page_size=4, **decode_kwargs):
    """P and D over tcp; in draft-on-decode-only mode P loads no draft (as `specpd serve` builds it)."""
    from specpd.disagg.decode import DecodeWorker
    from specpd.disagg.prefill import PrefillWorker
    decode_only = spec is not None and spec.draft_mode == "decode-only"
    p = PrefillWorker(make_engine(model_dir, page_size, spec, with_draft=not decode_only), "tcp",
                      bootstrap_port=0)
    d = DecodeWorker(make_engine(model_dir, page_size, spec), "tcp", **decode_kwargs)
    return p, d


FIRST_LOGPROB: dict = {}  # request id -> the logprob entry of its first output token (run_pd / run_unified)


def run_unified(engine, prompts, params) -> list:
    final = {}
    for i, prompt in enumerate(prompts):
        engine.add_request(f"u{i}", prompt, params)
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.new_logprobs and out.request_id not in FIRST_LOGPROB:
                FIRST_LOGPROB[out.request_id] = out.new_logprobs[0]
            if out.finished:
                final[out.request_id] = out
    return [final[f"u{i}"] for i in range(len(prompts))]


def run_pd(p, d, prompts, params, room_base=1000):
    """Drive a PrefillWorker and a DecodeWorker by hand; returns the final outputs by request id."""
    from specpd.disagg.worker import BootstrapInfo
    for i, prompt in enumerate(prompts):
        info = BootstrapInfo("127.0.0.1", p.bootstrap.port, room_base + i)
        p.expect(f"p{i}", info)
        p.add_request(f"p{i}", prompt, params)
        d.bootstrap(f"d{i}", info)
        d.add_request(f"d{i}", prompt, params)
    final, deadline = {}, time.monotonic() + 60
    while (p.has_unfinished_requests() or d.has_unfinished_requests()) and time.monotonic() < deadline:
        for worker in (p, d):
            for out in worker.step():
                assert out.error is None, out.error
                if out.new_logprobs and out.request_id not in FIRST_LOGPROB:
                    FIRST_LOGPROB[out.request_id] = out.new_logprobs[0]
                if out.finished:
                    final[out.request_id] = out
    assert all(final[f"p{i}"].finish_reason == "handoff" for i in range(len(prompts)))
    return final


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
    from specpd.draft.loader import random_draft_checkpoint
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
        # the draft's layers sit in the target's pages: one pool, one descriptor per page for both
        assert d.engine.spec_runner.proposer.pool.parent is d.engine.runner.kv_pool
        assert len(p.backend.layouts) == len(d.backend.layouts) == 1
        d_page = d.backend.layouts[0].page_bytes
        if mode == "both":
            assert p.peer_config.draft_mode == "both" and p.backend.layouts[0].page_bytes == d_page
        else:  # P has no draft: its target-only pages fill the prefix of D's pages, D builds the draft KV
            assert p.peer_config.draft_mode == "decode_only" and p.engine.spec_runner is None
            assert p.backend.layouts[0].page_bytes < d_page
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
    from specpd.draft.loader import random_draft_checkpoint
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
    """The adaptive policy NOT pinned (engine-wide learning, probes on their budget, the free probe of a draft
    in step), requests one at a time as a client sends them, one cost table for both sides: D plans every round
    of every request exactly as the unified engine does. A committed handoff starts with the draft state (both:
    P's, decode-only: D's own extend) and the policy state the unified engine's request has after its prefill:
    nothing deferred, its first-round top-k (issue 31 asked whether it did; this is the check)."""
    from specpd.draft.loader import random_draft_checkpoint
    from specpd.engine.spec_cost import CostModel
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
        assert any(probed for r in want_rounds for _, probed in r)  # and probed
        assert p.free_pages == 64 and d.free_pages == 64
    finally:
        p.close()
        d.close()


def test_duplicate_room_is_refused_and_the_first_owner_finishes(model_dir):
    from specpd.core import InvalidRequest
    from specpd.disagg.decode import DecodeWorker
    from specpd.disagg.worker import BootstrapInfo
    p, d = make_workers(model_dir)
    d2 = DecodeWorker(make_engine(model_dir), "tcp")
    expected = make_engine(model_dir).generate([PROMPTS[1]], GREEDY)[0].token_ids
    try:
        info = BootstrapInfo("127.0.0.1", p.bootstrap.port, 77)
        p.expect("p0", info)
        p.add_request("p0", PROMPTS[1], GREEDY)
        d.bootstrap("d0", info)
        d.add_request("d0", PROMPTS[1], GREEDY)
        p.expect("p1", info)  # the same room again on P: refused, the first request untouched
        with pytest.raises(InvalidRequest, match="room 77 is already in use"):
            p.add_request("p1", PROMPTS[0], GREEDY)
        d.bootstrap("d1", info)  # ... and on D
        with pytest.raises(InvalidRequest, match="room 77 is already in use"):
            d.add_request("d1", PROMPTS[0], GREEDY)
        d.step()  # D registers room 77 with P first
        p.step()
        d2.bootstrap("x0", info)  # a second decode server claims the same room: P refuses it
        d2.add_request("x0", PROMPTS[0], GREEDY)
        final, deadline = {}, time.monotonic() + 30
        while (p.has_unfinished_requests() or d.has_unfinished_requests() or d2.has_unfinished_requests()) \
                and time.monotonic() < deadline:
            for worker in (p, d, d2):
                for out in worker.step():
                    if out.finished:
                        final[out.request_id] = out
        assert final["x0"].finish_reason == "abort" and "already in use" in final["x0"].error
        assert final["p0"].finish_reason == "handoff" and final["d0"].error is None
        assert final["d0"].token_ids == expected
        assert p.free_pages == d.free_pages == d2.free_pages == 64
    finally:
        for w in (p, d, d2):
            w.close()


def test_a_dead_prefill_fails_its_rooms_fast_and_frees_the_pages(model_dir):
    """P gone (its bootstrap port refuses): after the heartbeat timeout the client gets an error and the
    pages come back at once, with no wait for the abort timeout."""
    from specpd.disagg.worker import BootstrapInfo
    p, d = make_workers(model_dir, heartbeat_timeout_s=0.5, abort_timeout_s=600)
    try:
        info = BootstrapInfo("127.0.0.1", p.bootstrap.port, 9)
        d.bootstrap("d0", info)
        d.add_request("d0", PROMPTS[1], GREEDY)  # P never gets its half: D waits for the handoff
        d.step()
        assert d.free_pages < 64 and d.queue_sizes()["pd_transfer"] == 1
        p.close()
        start, outs = time.monotonic(), []
        while d.has_unfinished_requests() and time.monotonic() - start < 10:
            outs += d.step()
        assert time.monotonic() - start < 3
        assert [o.finish_reason for o in outs] == ["abort"] and "is gone" in outs[0].error
        assert d.free_pages == 64
    finally:
        d.close()


def test_waiting_for_prefill_times_out(model_dir):
    """P alive but the room never prefilled: the client hears after prefill_timeout_s; the pages follow once
    P confirms nothing is in flight (here: P's bootstrap-timeout TransferFailed for the unknown room)."""
    from specpd.disagg.worker import BootstrapInfo
    p, d = make_workers(model_dir, prefill_timeout_s=0.5)
    p.bootstrap_timeout_s = 1.0
    try:
        info = BootstrapInfo("127.0.0.1", p.bootstrap.port, 10)
        d.bootstrap("d0", info)
        d.add_request("d0", PROMPTS[1], GREEDY)
        start, outs = time.monotonic(), []
        while (d.has_unfinished_requests() or p.has_unfinished_requests()) and time.monotonic() - start < 10:
            outs += d.step()
            p.step()
        assert [o.finish_reason for o in outs] == ["abort"] and "did not finish within 0.5 s" in outs[0].error
        assert d.free_pages == 64 and p.free_pages == 64
    finally:
        p.close()
        d.close()


def test_decode_refuses_a_mismatched_prefill(model_dir):
    from specpd.core import InvalidRequest
    from specpd.disagg.decode import DecodeWorker
    from specpd.disagg.prefill import PrefillWorker
    from specpd.disagg.worker import BootstrapInfo
    p = PrefillWorker(make_engine(model_dir, page_size=8), "tcp", bootstrap_port=0)  # 0: the OS picks (no race)
    d = DecodeWorker(make_engine(model_dir, page_size=4), "tcp")
    try:
        with pytest.raises(InvalidRequest, match="page_size: prefill=8 decode=4"):
            d.bootstrap("d0", BootstrapInfo("127.0.0.1", p.bootstrap.port, 7))
    finally:
        p.close()
        d.close()


def test_abort_with_a_dead_prefill_frees_after_the_hard_timeout(model_dir):
    from specpd.disagg.decode import DecodeWorker
    from specpd.disagg.prefill import PrefillWorker
    from specpd.disagg.worker import BootstrapInfo
    p = PrefillWorker(make_engine(model_dir), "tcp", bootstrap_port=0)
    d = DecodeWorker(make_engine(model_dir), "tcp", abort_timeout_s=0.2)
    try:
        d.bootstrap("d0", BootstrapInfo("127.0.0.1", p.bootstrap.port, 5))
        p.close()  # P dies before it ever sees the room
        d.add_request("d0", PROMPTS[1], GREEDY)
        d.step()
        assert d.free_pages < 64 and d.queue_sizes()["pd_transfer"] == 1
        d.abort_request("d0")
        outs, deadline = [], time.monotonic() + 5
        while d.has_unfinished_requests() and time.monotonic() < deadline:
            outs += d.step()
        assert [o.finish_reason for o in outs] == ["abort"] and d.free_pages == 64
    finally:
        d.close()


@pytest.mark.skipif(not backend_available("mooncake")[0], reason="mooncake does not load here")
def test_decode_refuses_a_prefill_on_another_transfer_backend(model_dir):
    """P on tcp, D on mooncake: refused at bootstrap (PeerConfig), both names in the error, no room opened."""
    from specpd.core import InvalidRequest
    from specpd.disagg.decode import DecodeWorker
    from specpd.disagg.prefill import PrefillWorker
    from specpd.disagg.worker import BootstrapInfo
    p = PrefillWorker(make_engine(model_dir), "tcp", bootstrap_port=0)
    d = DecodeWorker(make_engine(model_dir), "mooncake")
    try:
        with pytest.raises(InvalidRequest, match="transfer_backend: prefill='tcp' decode='mooncake'"):
            d.bootstrap("d0", BootstrapInfo("127.0.0.1", p.bootstrap.port, 8))
        assert d.free_pages == 64 and not d.has_unfinished_requests()
    finally:
        p.close()
        d.close()
