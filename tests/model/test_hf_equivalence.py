"""Greedy output is token-identical to HF transformers (fp32, batch 1), and batching changes nothing."""
import pytest
import torch

from specpd.config import CacheConfig, EngineConfig, SchedulerConfig
from specpd.core import SamplingParams
from specpd.engine.llm_engine import LLMEngine
from tests.model.hf_models import save_tiny_model

ARCHS = ["llama", "llama3", "qwen2", "qwen3"]
PROMPTS = [[5, 17, 99, 3], list(range(40, 77)), [250, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13], [7]]


@pytest.fixture(scope="module", params=ARCHS)
def tiny(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    model = save_tiny_model(request.param, path)
    return request.param, str(path), model


def hf_greedy(model, prompt, n):
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=n, min_new_tokens=n, do_sample=False,
                             attention_mask=torch.ones(1, len(prompt), dtype=torch.long))
    return out[0, len(prompt):].tolist()


def make_engine(path, page_size=4, num_pages=256, chunk=512, budget=2048, backend="torch"):
    cfg = EngineConfig(model=path, attention_backend=backend,
                       cache=CacheConfig(page_size=page_size, num_pages=num_pages),
                       scheduler=SchedulerConfig(max_num_batched_tokens=budget, chunked_prefill_size=chunk))
    return LLMEngine(cfg)


GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)


def test_greedy_matches_hf_batch1(tiny):
    arch, path, model = tiny
    engine = make_engine(path)
    start = engine.free_pages
    for prompt in PROMPTS:
        ours = engine.generate([prompt], GREEDY)[0].token_ids
        assert ours == hf_greedy(model, prompt, GREEDY.max_tokens), f"{arch} prompt {prompt[:5]}"
    assert engine.free_pages == start


@pytest.mark.parametrize("page_size,chunk", [(4, 512), (16, 8), (1, 5)])
def test_ragged_batch_equals_alone(tiny, page_size, chunk):
    arch, path, _ = tiny
    engine = make_engine(path, page_size=page_size, chunk=chunk, num_pages=1024 // page_size)
    start = engine.free_pages
    alone = [engine.generate([p], GREEDY)[0].token_ids for p in PROMPTS]
    batched = [o.token_ids for o in engine.generate(PROMPTS, GREEDY)]
    assert batched == alone
    assert engine.free_pages == start


def test_preemption_under_page_pressure(tiny):
    """A pool too small for all requests at once forces preemption + recompute; outputs are unchanged."""
    arch, path, _ = tiny
    roomy = make_engine(path)
    expected = [o.token_ids for o in roomy.generate(PROMPTS, GREEDY)]
    tight = make_engine(path, page_size=4, num_pages=18)
    got = [o.token_ids for o in tight.generate(PROMPTS, GREEDY)]
    assert got == expected
    assert tight.free_pages == 18
