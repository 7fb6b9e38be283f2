"""n > 1: a request's parallel samples are engine requests of their own; the ones after the first wait until the
first has computed the prompt, then take its full prompt pages from the prefix cache (Scheduler.share_prefix), with
plain decoding and with a speculative tree (draft KV in the pages). Outputs equal independent runs; pages come back."""
import pytest

from specpd.config import CacheConfig, EngineConfig, SchedulerConfig, SpecConfig
from specpd.core import SamplingParams
from specpd.engine.llm_engine import LLMEngine

PS = 4
NUM_PAGES = 160
PROMPT = list(range(40, 77))  # 37 tokens: 9 full pages and one token over
GREEDY = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)


def _engine(model_dir, spec=None):
    return LLMEngine(EngineConfig(model=model_dir, cache=CacheConfig(page_size=PS, num_pages=NUM_PAGES),
                                  scheduler=SchedulerConfig(chunked_prefill_size=16), spec=spec or SpecConfig()))


def _samples(engine, n, params, others=()):
    engine.add_request("s0", PROMPT, params)
    for i in range(1, n):
        engine.add_request(f"s{i}", PROMPT, params, follows="s0")
    for j, prompt in enumerate(others):  # unrelated requests queued behind them
        engine.add_request(f"o{j}", prompt, params)
    final = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                final[out.request_id] = out
    return final


@pytest.mark.parametrize("spec", ["plain", "eagle3 tree"])
def test_parallel_samples_share_the_prompt_pages(tiny_llama_dir, tiny_eagle3_dir, spec):
    config = None if spec == "plain" else SpecConfig("eagle3", draft_model=tiny_eagle3_dir, spec_num_steps=3,
                                                     spec_topk=2, spec_num_draft_tokens=6, spec_adaptive_pinned=True)
    engine = _engine(tiny_llama_dir, config)
    alone = engine.generate([PROMPT, [7, 8, 9]], GREEDY)
    engine.flush_cache()
    final = _samples(engine, 4, GREEDY, others=[[7, 8, 9]])
    assert [final[f"s{i}"].token_ids for i in range(4)] == [alone[0].token_ids] * 4
    assert final["o0"].token_ids == alone[1].token_ids
    assert final["s0"].num_cached_tokens == 0
    # the prompt's full pages below its last token, from the first sample's prefill
    assert [final[f"s{i}"].num_cached_tokens for i in range(1, 4)] == [(len(PROMPT) - 1) // PS * PS] * 3
    assert engine.free_pages == NUM_PAGES


def test_samples_of_a_short_request_still_share(tiny_llama_dir):
    """The first sample may finish before the others start (max_tokens 1): its pages went to the cache then."""
    engine = _engine(tiny_llama_dir)
    final = _samples(engine, 3, SamplingParams(max_tokens=1, temperature=0.0))
    assert len({tuple(o.token_ids) for o in final.values()}) == 1
    assert final["s2"].num_cached_tokens == (len(PROMPT) - 1) // PS * PS
    assert engine.free_pages == NUM_PAGES
