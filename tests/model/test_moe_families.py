"""DeepSeek-V3 (MLA over the paged latent rows, MoE, YaRN) and GLM-4.5 (GQA + partial RoPE, MoE) against
transformers' own classes, tiny random configs built in the test (tests/model/moe_models.py):
  - fp32 logits within 1e-4 of transformers' at every row of one ragged step over scattered pages: a prompt chunk
    after its prefix, a decode row, and a tree of verify rows (each node against transformers over its path);
  - greedy output token-identical to transformers' generate, batch 1, and a ragged batch equal to each request alone
    across page sizes and chunked prefill, every page back;
  - what is not served is refused naming the values (tensor parallelism, weight-only quantization).
"""
import random

import pytest
import torch

from specpd.attention.metadata import AttentionMetadata
from specpd.config import CacheConfig, EngineConfig, SchedulerConfig
from specpd.core import SamplingParams
from specpd.engine.llm_engine import LLMEngine
from specpd.kv.latent_pool import LatentKVPool
from tests.model.moe_models import FAMILIES, save_tiny_moe

PROMPTS = [[5, 17, 99, 3], list(range(40, 77)), [250, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13], [7]]
GREEDY = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module", params=list(FAMILIES))
def moe(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    model, _ = save_tiny_moe(request.param, path)
    return request.param, str(path), model


def make_engine(path, page_size=4, num_pages=128, chunk=512, backend="torch", **kw):
    return LLMEngine(EngineConfig(model=path, attention_backend=backend,
                                  cache=CacheConfig(page_size=page_size, num_pages=num_pages),
                                  scheduler=SchedulerConfig(chunked_prefill_size=chunk), **kw))


@torch.no_grad()
def hf_logits(model, tokens: list[int]) -> torch.Tensor:
    return model(torch.tensor([tokens])).logits[0].float()  # [len, vocab]


def hf_greedy(model, prompt, n):
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=n, min_new_tokens=n, do_sample=False,
                             attention_mask=torch.ones(1, len(prompt), dtype=torch.long))
    return out[0, len(prompt):].tolist()


def test_logits_match_hf_on_ragged_step_with_tree_over_scattered_pages(moe):
    family, path, model = moe
    engine = make_engine(path, page_size=4, num_pages=64)
    runner = engine.runner
    assert isinstance(runner.kv_pool, LatentKVPool) == family.startswith("deepseek")
    allocator, page = runner.kv_pool.allocator, runner.kv_pool.page_size
    free = allocator.alloc(allocator.num_free)
    random.Random(3).shuffle(free)
    prompts = [list(range(40, 59)), [5, 17, 99, 3, 8, 250, 11], list(range(100, 110))]
    pages = [free[0:6], free[6:9], free[9:13]]
    prefix = [11, 6, 9]
    # a tree of 5 nodes after prompts[2][:9]: 0 is the root (the prompt's next token), 1 and 2 its children, 3 under
    # 1, 4 under 2; node i sits at slot 9 + i, RoPE position 9 + depth
    tokens, parents, depth = [109, 31, 77, 260, 5], [-1, 0, 0, 1, 2], [0, 1, 1, 2, 2]
    mask = torch.eye(5, dtype=torch.bool)
    for i in range(5):
        j = parents[i]
        while j >= 0:
            mask[i, j], j = True, parents[j]

    def forward(q_lens, kv_lens, ids, positions, masks=None):
        meta = AttentionMetadata.build(q_lens, kv_lens, pages, page, tree_masks=masks)
        with torch.inference_mode():
            runner.backend.plan(meta)
            hidden, _ = runner.model(torch.tensor(ids), torch.tensor(positions), runner.backend, meta)
            return runner.model.compute_logits(hidden)

    first = forward(prefix, prefix, [t for p, n in zip(prompts, prefix) for t in p[:n]],
                    [i for n in prefix for i in range(n)])
    got = forward([8, 1, 5], [19, 7, 14], prompts[0][11:] + [prompts[1][6]] + tokens,
                  list(range(11, 19)) + [6] + [9 + d for d in depth], [None, None, mask])
    want_first = torch.cat([hf_logits(model, p[:n]) for p, n in zip(prompts, prefix)])
    paths = []
    for i in range(5):
        path_tokens, j = [], i
        while j >= 0:
            path_tokens.insert(0, tokens[j])
            j = parents[j]
        paths.append(hf_logits(model, prompts[2][:9] + path_tokens)[-1:])
    want = torch.cat([hf_logits(model, prompts[0])[11:], hf_logits(model, prompts[1])[6:7]] + paths)
    assert (first - want_first).abs().max().item() <= 1e-4
    assert (got - want).abs().max().item() <= 1e-4, family
    assert want.std().item() > 0.5  # logits that tell tokens apart
    allocator.free(free)


@pytest.mark.parametrize("backend", ["torch", "cpu"])
def test_greedy_matches_hf_batch1(moe, backend):
    family, path, model = moe
    engine = make_engine(path, backend=backend)
    start = engine.free_pages
    for prompt in PROMPTS:
        ours = engine.generate([prompt], GREEDY)[0].token_ids
        assert ours == hf_greedy(model, prompt, GREEDY.max_tokens), f"{family} prompt {prompt[:5]}"
    assert engine.free_pages == start == engine.total_pages


@pytest.mark.parametrize("page_size,chunk", [(4, 512), (16, 8), (1, 5)])
def test_ragged_batch_equals_alone(moe, page_size, chunk):
    family, path, _ = moe
    engine = make_engine(path, page_size=page_size, chunk=chunk, num_pages=1024 // page_size)
    alone = [engine.generate([p], GREEDY)[0].token_ids for p in PROMPTS]
    assert [o.token_ids for o in engine.generate(PROMPTS, GREEDY)] == alone
    assert engine.free_pages == engine.total_pages


def test_refused_configurations_name_the_values(moe):
    family, path, _ = moe
    with pytest.raises(ValueError, match=r"--tp-size 2 is not supported for (deepseek_v3|glm4_moe)"):
        make_engine(path, tp_size=2)
    with pytest.raises(ValueError, match=r"--quantization int8 is not supported"):
        make_engine(path, quantization="int8", dtype="bfloat16")
