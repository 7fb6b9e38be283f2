"""EAGLE-3's C draft forward (specpd/spec/draft/eagle3_stack.py) against the Python path it replaces, bit for bit: the
output rows and every K/V byte of the draft's layer, on ragged batches over scattered pages across page
boundaries — the fused target features (fc) and draft hiddens, the last rows only (OutputRows), tree masks — and
in an engine: the same tokens, logprobs and verify outcomes. bf16 on a CPU with AVX512-BF16, fp32 on one with
AVX-512; the draft's linears dense and in int8 blocks (--spec-draft-quantization)."""
import dataclasses

import pytest
import torch

from specpd.config import CacheConfig, EngineConfig, SpecConfig
from specpd.core import SamplingParams
from specpd.spec.draft import eagle3_stack
from specpd.engine.llm_engine import LLMEngine
from specpd.model.loader import load_checkpoint
from tests.spec.test_smollm2 import collect_logprobs
from tests.model.test_cpu_stack import DTYPES

pytestmark = pytest.mark.skipif(eagle3_stack._fn() is None, reason="no C compiler (SPECPD_C_KERNELS=0)")

NUM_PAGES = 96
SPEC = SpecConfig("eagle3", draft_model="default", spec_num_steps=3, spec_topk=2, spec_num_draft_tokens=6,
                  spec_adaptive_pinned=True)


@pytest.fixture(scope="module")
def checkpoint():
    return load_checkpoint("default")


def _engine(checkpoint, dtype, draft_quantization="none"):
    spec = dataclasses.replace(SPEC, spec_draft_quantization=draft_quantization)
    return LLMEngine(EngineConfig(model="default", dtype=dtype, spec=spec,
                                  cache=CacheConfig(page_size=16, num_pages=NUM_PAGES)), checkpoint=checkpoint)


def _both(proposer, *args, **kw):
    """(C, Python) outputs and the draft layer's K/V after each, the same call run twice into the same slots."""
    draft, pool = proposer.draft, proposer.pool
    stack, calls = draft.cpu_stack, []
    run = stack.run

    def counted(*a, **k):
        out = run(*a, **k)
        calls.append(out is not None)
        return out
    stack.run = counted
    got = proposer._run(*args, **kw)
    got_kv = pool.buffer.clone()
    draft.cpu_stack = None
    try:
        want = proposer._run(*args, **kw)
    finally:
        draft.cpu_stack = stack
        stack.run = run
    assert calls == [True], "the C path ran"
    return got, want, got_kv, pool.buffer.clone()


@pytest.mark.parametrize("draft_quantization", ["none", "int8"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_draft_stack_equals_python_path_on_ragged_scattered_pages(checkpoint, dtype, draft_quantization):
    engine = _engine(checkpoint, dtype, draft_quantization)
    proposer = engine.spec_runner.proposer.model
    quantized = {type(m).__name__ for m in proposer.draft.modules()} & {"QuantLinear"}
    assert bool(quantized) == (draft_quantization == "int8")
    width = proposer.draft.config.hidden_size
    fused = proposer.draft.fc.in_features
    gen = torch.Generator().manual_seed(0)
    alloc = engine.runner.kv_pool.allocator
    with torch.inference_mode():
        for trial in range(24):
            n = int(torch.randint(1, 4, (1,), generator=gen))
            q_lens = [int(torch.randint(1, 6, (1,), generator=gen)) for _ in range(n)]
            ctx = [int(torch.randint(0, 60, (1,), generator=gen)) for _ in range(n)]
            ctx[0] = 16 - q_lens[0] // 2 if trial % 3 == 0 else ctx[0]  # rows across a page boundary
            if trial % 6 == 5:  # a catch-up's many rows (a deferred prompt): the last one goes on
                q_lens[0] = 37
            pages = [alloc.alloc(7) for _ in range(n)]
            # scattered: the allocator's order shuffled
            pages = [[p[i] for i in torch.randperm(len(p), generator=gen).tolist()] for p in pages]
            ids, pos, kv = [], [], []
            for q, c in zip(q_lens, ctx):
                ids += torch.randint(0, 8000, (q,), generator=gen).tolist()
                pos += list(range(c, c + q))
                kv.append(c + q)
            hidden = torch.randn(sum(q_lens), fused if trial % 2 == 0 else width, generator=gen)
            hidden = hidden.to(proposer.draft.cpu_stack.dtype)
            tree = trial % 4 == 3
            masks = None
            if tree:  # each item's rows see a random subset of its rows at or before themselves
                masks = []
                for q in q_lens:
                    m = torch.rand(q, q, generator=gen) < 0.5
                    masks.append((m.tril() | torch.eye(q, dtype=torch.bool)))
            last_only = not tree and trial % 4 in (1, 2)
            got, want, got_kv, want_kv = _both(proposer, ids, hidden, pos, q_lens, kv, pages, step=trial % 3,
                                               tree_masks=masks, last_only=last_only)
            assert got.shape == want.shape == (n if last_only else sum(q_lens), width)
            assert torch.equal(got, want), (trial, q_lens, ctx)
            assert torch.equal(got_kv, want_kv), (trial, q_lens, ctx)
            for p in pages:
                alloc.free(p)
    assert engine.free_pages == NUM_PAGES


@pytest.mark.parametrize("dtype", DTYPES)
def test_draft_stack_engine_equals_python_path(checkpoint, dtype):
    tok = checkpoint.tokenizer
    prompts = [tok.encode(tok.apply_chat_template([{"role": "user", "content": q}]))
               for q in ("Write a haiku about rain on a tin roof, then explain it.", "Name three prime numbers.")]
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, logprobs=2)
    outs = []
    for stack in (True, False):
        engine = _engine(checkpoint, dtype)
        draft = engine.spec_runner.proposer.model.draft
        assert draft.cpu_stack is not None
        if not stack:
            draft.cpu_stack = None
        res = collect_logprobs(engine, prompts, params=params)
        stats = engine.spec_runner.policy.stats
        outs.append(([[(lp.token_id, lp.logprob, lp.top) for lp in r] for r in res], stats.rounds,
                     dict(stats.proposed_hist), engine.runner.kv_pool.buffer.clone()))
        assert engine.free_pages == NUM_PAGES
    (got, rounds, hist, kv), (want, want_rounds, want_hist, want_kv) = outs
    assert got == want and rounds == want_rounds and hist == want_hist
    assert torch.equal(kv, want_kv)


@pytest.mark.parametrize("dtype", DTYPES)
def test_draft_stack_declines_what_it_does_not_run(checkpoint, dtype):
    engine = _engine(checkpoint, dtype)
    proposer = engine.spec_runner.proposer.model
    stack = proposer.draft.cpu_stack
    h = torch.zeros(2, proposer.draft.config.hidden_size, dtype=stack.dtype)
    with torch.enable_grad():
        assert stack.run(h, h, None, proposer.backend, None) is None  # autograd: the Python path
    other = (torch.float32 if stack.dtype == torch.bfloat16 else torch.bfloat16)
    assert stack.run(h.to(other), h.to(other), None, proposer.backend, None) is None  # not the weights' dtype
    rows = stack.max_rows + 1
    if rows < 1 << 20:  # AMX with SPECPD_GEMM_AMX=0: the kernel takes up to 16 rows, more go through oneDNN and Python
        big = torch.zeros(rows, h.shape[1], dtype=stack.dtype)
        assert stack.run(big, big, None, proposer.backend, None) is None
    fp16 = LLMEngine(EngineConfig(model="default", dtype="float16", spec=SPEC,
                                  cache=CacheConfig(page_size=16, num_pages=8)), checkpoint=checkpoint)
    assert fp16.spec_runner.proposer.model.draft.cpu_stack is None
