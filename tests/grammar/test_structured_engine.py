"""Constrained generation on SmolLM2 with the shipped EAGLE-3 draft and n-gram trees: every output parses and
validates, greedy output is token-identical with and without speculation (chain, tree -- with requests preempted
mid-output by a tight page pool -- and n-gram tree), and the precedence rules (grammar end before min_tokens, stop
strings still cut) hold."""
import json
import math
import re
import time

import pytest

from specpd.config import CacheConfig, EngineConfig, SpecConfig
from specpd.core import SamplingParams
from specpd.engine.llm_engine import LLMEngine
from tests.grammar.cases import CASES, CHOICES, COPY, NUM_PAGES, check


def run(engine, prompts, params, num_pages=NUM_PAGES):
    """The outputs in input order, and the ids of requests preempted while holding output (and so a grammar
    state past the start): each is back in the waiting queue with its tokens, to be recomputed."""
    ids = [f"run-{time.monotonic_ns()}-{i}" for i in range(len(prompts))]
    for rid, prompt, p in zip(ids, prompts, params):
        engine.add_request(rid, prompt, p)
    final, preempted = {}, set()
    while engine.has_unfinished_requests():
        final.update((out.request_id, out) for out in engine.step() if out.finished)
        preempted |= {r.request_id for r in engine.scheduler.waiting if r.output_token_ids}
    assert engine.free_pages == num_pages
    return [final[rid] for rid in ids], preempted


def test_outputs_validate_without_speculation(plain, reference):
    assert plain.grammar.info.stop_token_ids == list(plain.eos_token_ids)  # the matcher's stop set
    for out, (_, _, how) in zip(reference, CASES):
        assert out.finish_reason == "stop", out.text
        check(out.text, how)
    assert plain.stats()["grammar_mask_seconds"] > 0


def test_grammar_end_precedes_min_tokens_and_stop_strings_still_cut(plain, prompts):
    choice = SamplingParams(max_tokens=8, temperature=0.0, min_tokens=6, constraint_kind="choice",
                            constraint_spec=json.dumps(CHOICES))
    words = SamplingParams(max_tokens=16, temperature=0.0, stop=(" ",), constraint_kind="regex",
                           constraint_spec="[a-z]+ [a-z]+")
    (ended, cut), _ = run(plain, prompts[2:3] * 2, [choice, words])
    assert ended.finish_reason == "stop" and ended.text in CHOICES and len(ended.token_ids) < 6
    assert cut.finish_reason == "stop" and cut.stop_reason == " " and re.fullmatch("[a-z]+", cut.text)


TIGHT_PAGES = 14  # the four short cases fit; the copy (77 prompt tokens) preempts, mid-output, and recomputes


@pytest.mark.parametrize("algorithm,steps,topk,num_tokens,num_pages", [
    ("eagle3", 3, 1, None, NUM_PAGES), ("eagle3", 3, 4, 8, TIGHT_PAGES), ("ngram", 4, 2, 6, NUM_PAGES)],
    ids=["chain", "tree_preempted", "ngram_tree"])
def test_speculation_is_token_identical_and_valid(smollm2, prompts, reference, algorithm, steps, topk, num_tokens,
                                                  num_pages):
    """tree_preempted: a pool too small for every request at once -- a request preempted while its grammar is
    mid-output recomputes and resumes from its kept matcher state; the output is the unpreempted one."""
    spec = SpecConfig(algorithm, draft_model="default" if algorithm == "eagle3" else None, spec_num_steps=steps,
                      spec_topk=topk, spec_num_draft_tokens=num_tokens, spec_adaptive_pinned=True)
    engine = LLMEngine(EngineConfig(model="default", cache=CacheConfig(page_size=16, num_pages=num_pages), spec=spec),
                       checkpoint=smollm2)
    outs, preempted = run(engine, prompts, [p for _, p, _ in CASES], num_pages)
    assert bool(preempted) == (num_pages == TIGHT_PAGES), preempted
    for out, ref, (_, params, how) in zip(outs, reference, CASES):
        assert out.finish_reason == "stop", out.text
        check(out.text, how)
        if params.greedy:
            assert out.token_ids == ref.token_ids
    assert engine.spec_stats.verify_count > 0
    if algorithm == "eagle3":  # n-gram matches on these short outputs are luck
        assert engine.spec_stats.accepted_tokens > 0
    else:  # but the copy is n-gram text: its drafts, grammar-pruned, keep acceptance up
        copy = outs[COPY]
        assert copy.spec_accepted_tokens >= 2 * copy.spec_verify_count > 0, (copy.spec_verify_count,
                                                                             copy.spec_accepted_tokens)


def test_logprobs_are_those_of_the_masked_distribution(plain, prompts):
    params = SamplingParams(max_tokens=8, temperature=0.0, logprobs=5, constraint_kind="choice",
                            constraint_spec=json.dumps(CHOICES))
    plain.add_request("lp", prompts[2], params)
    lps, text = [], ""
    while plain.has_unfinished_requests():
        for out in plain.step():
            lps += out.new_logprobs or []
            text = out.text
    first = lps[0]
    assert text in CHOICES and math.isfinite(first.logprob)
    finite = [t for t, v in first.top if math.isfinite(v)]
    assert first.token_id in finite
    for t in finite:  # every token the first step could take starts a choice
        assert any(c.startswith(plain.tokenizer.decode([t])) for c in CHOICES), plain.tokenizer.decode([t])
