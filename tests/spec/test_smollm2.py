"""Speculation on SmolLM2-135M (the default model): every draft family is lossless in a ragged batch,
and logprobs come out of the verify logits equal to non-speculative ones."""
import pytest

from specpd.config import CacheConfig, EngineConfig, ModelConfig, SpecConfig
from specpd.core import SamplingParams
from specpd.spec.draft.loader import random_draft_checkpoint
from specpd.engine.llm_engine import LLMEngine
from specpd.machine import native_bf16
from specpd.model.loader import load_checkpoint

QUESTIONS = ["What is the capital of France?", "Write a haiku about rain.", "Name three prime numbers."]
PARAMS = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=2)
NUM_PAGES = 64


@pytest.fixture(scope="module")
def checkpoint():
    return load_checkpoint("default")


@pytest.fixture(scope="module")
def prompts(checkpoint):
    tok = checkpoint.tokenizer
    return [tok.encode(tok.apply_chat_template([{"role": "user", "content": q}])) for q in QUESTIONS]


@pytest.fixture(scope="module")
def reference(checkpoint, prompts):
    engine = LLMEngine(EngineConfig(model="default", cache=CacheConfig(page_size=16, num_pages=NUM_PAGES)),
                       checkpoint=checkpoint)
    return engine.generate(prompts, PARAMS)


@pytest.mark.parametrize("algorithm,topk,num_tokens", [("eagle", 1, None), ("eagle3", 2, 6), ("mtp", 1, None)])
def test_smollm2_spec_is_lossless(checkpoint, prompts, reference, tmp_path, algorithm, topk, num_tokens):
    random_draft_checkpoint(str(tmp_path), algorithm, ModelConfig.from_hf(checkpoint.hf_config), seed=0)
    spec = SpecConfig(algorithm, draft_model=str(tmp_path), spec_num_steps=3, spec_topk=topk,
                      spec_num_draft_tokens=num_tokens)
    engine = LLMEngine(EngineConfig(model="default", cache=CacheConfig(page_size=16, num_pages=NUM_PAGES),
                                    spec=spec), checkpoint=checkpoint)
    outs = engine.generate(prompts, PARAMS)
    assert [o.token_ids for o in outs] == [r.token_ids for r in reference]
    assert engine.free_pages == NUM_PAGES


def collect_logprobs(engine, prompts, references=None, params=PARAMS):
    """Step the engine, gathering every request's per-token logprobs in order."""
    ids = [f"lp{i}" for i in range(len(prompts))]
    for i, (rid, prompt) in enumerate(zip(ids, prompts)):
        if references is not None:
            engine.spec_runner.proposer.references[rid] = references[i]
        engine.add_request(rid, prompt, params)
    logprobs = {rid: [] for rid in ids}
    while engine.has_unfinished_requests():
        for out in engine.step():
            logprobs[out.request_id].extend(out.new_logprobs or [])
    return [logprobs[rid] for rid in ids]


def test_logprobs_with_speculation_come_from_verify_logits(checkpoint, prompts, reference):
    cache = CacheConfig(page_size=16, num_pages=NUM_PAGES)
    plain = collect_logprobs(LLMEngine(EngineConfig(model="default", cache=cache), checkpoint=checkpoint), prompts)
    spec_engine = LLMEngine(EngineConfig(model="default", cache=cache, spec=SpecConfig("replay", spec_num_steps=4, spec_adaptive=False)),
                            checkpoint=checkpoint)
    spec = collect_logprobs(spec_engine, prompts, [r.token_ids for r in reference])
    assert spec_engine.spec_stats.accepted_tokens > 0
    for got, want, ref in zip(spec, plain, reference):
        assert [lp.token_id for lp in got] == [lp.token_id for lp in want] == ref.token_ids
        for a, b in zip(got, want):
            assert abs(a.logprob - b.logprob) < 1e-4
            assert [t for t, _ in a.top] == [t for t, _ in b.top]
            assert all(abs(x - y) < 1e-4 for (_, x), (_, y) in zip(a.top, b.top))


@pytest.mark.skipif(not native_bf16(), reason="bf16 is the serving default only where the CPU computes it natively")
def test_bf16_greedy_speculation_equals_plain_within_the_invariant_width(checkpoint, prompts):
    """In bf16 (what `specpd serve` runs here) a verify row rounds as the same row decoded alone while a step's
    GEMMs stay within the batch-invariant width (cpu_linear's docstring): two requests with 7-row trees are 14
    rows, under it on every CPU (any width with the bf16 kernel, AMX tiles or not; 16 on AMX with
    SPECPD_GEMM_AMX=0; 32 with oneDNN alone)."""
    cache = CacheConfig(page_size=16, num_pages=NUM_PAGES)
    pair = prompts[:2]
    plain = collect_logprobs(LLMEngine(EngineConfig(model="default", dtype="bfloat16", cache=cache),
                                       checkpoint=checkpoint), pair)
    spec = SpecConfig("eagle3", draft_model="default", spec_num_steps=3, spec_topk=2, spec_num_draft_tokens=6,
                      spec_adaptive_pinned=True)
    engine = LLMEngine(EngineConfig(model="default", dtype="bfloat16", cache=cache, spec=spec), checkpoint=checkpoint)
    got = collect_logprobs(engine, pair)
    assert engine.spec_stats.accepted_tokens > 0
    # bit for bit: the tokens, and every logprob (a verify row's logits rounded as the decode row's)
    assert [[(lp.token_id, lp.logprob, lp.top) for lp in r] for r in got] == \
        [[(lp.token_id, lp.logprob, lp.top) for lp in r] for r in plain]
    assert engine.free_pages == NUM_PAGES
