"""On a CUDA GPU: the Triton kernels compiled for the device, the attention backends and the engine, against
the torch reference and against the CPU engine.

Skipped without a CUDA device (tests/conftest.py then sets TRITON_INTERPRET=1; on a CUDA machine it does not, so
`make test` runs them). The engine runs with its defaults there: CUDA graphs on (tests/gpu/test_cuda_graphs.py
compares them with eager). The kernel cases are the CPU suite's tables
(ragged, scattered pages, page boundaries, trees with nodes out of order), built on the host with the same
helpers and moved to the device, plus SmolLM2-135M's shapes (9 query heads over 3 KV heads, head dim 64,
page 16) at lengths and batch sizes the interpreter is too slow for. References run on the host in fp32.
"""
from __future__ import annotations

import os

import pytest
import torch

from specpd.attention.metadata import AttentionMetadata
from specpd.attention.reference import paged_attention_ref
from specpd.attention.torch_backend import TorchAttentionBackend
from specpd.attention.triton_backend import TritonAttentionBackend
from specpd.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig, SpecConfig
from specpd.core import SamplingParams
from specpd.spec.draft.loader import random_draft_checkpoint
from specpd.engine.llm_engine import LLMEngine
from specpd.kernels.kv_compact import compact_kv, compact_kv_ref
from specpd.kernels.paged_attention import paged_decode_attention, paged_extend_attention
from specpd.kv.pool import KVPool
from specpd.model.loader import load_checkpoint
from tests.kernels.test_kv_compact import KERNEL_CASES, accepted_paths_batch
from tests.kernels.test_paged_attention import DECODE_CASES, EXTEND_CASES, LAYER, TOL, make_batch
from tests.kernels.test_tree_attention import TREE_CASES, tree_batch
from tests.model.hf_models import save_tiny_model

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1",
    reason="needs a CUDA GPU and TRITON_INTERPRET=0 (the interpreter runs the kernels on the host)")
CUDA = "cuda"


def to_device(pool: KVPool, meta: AttentionMetadata, q: torch.Tensor):
    """The host batch on the GPU: the same pool contents and page lists; q on the device."""
    gpu_pool = KVPool(pool.num_pages, pool.num_layers, pool.page_size, pool.kv_heads, pool.head_dim, pool.dtype,
                      device=CUDA)
    gpu_pool.buffer.copy_(pool.buffer)
    page_lists = [meta.page_table[b, :(kv + pool.page_size - 1) // pool.page_size].tolist()
                  for b, kv in enumerate(meta.kv_lens_host)]
    return gpu_pool, page_lists, q.to(CUDA)


def host_reference(pool, meta, q, sm_scale, tree=False):
    extra = (meta.tree_mask, meta.tree_mask_indptr) if tree else ()
    return paged_attention_ref(q.float(), pool.k_cache(LAYER).float(), pool.v_cache(LAYER).float(), meta.qo_indptr,
                               meta.kv_lens, meta.page_table, sm_scale, *extra)


def gpu_meta(q_lens, kv_lens, page_lists, page_size, masks=None):
    return AttentionMetadata.build(q_lens, kv_lens, page_lists, page_size, device=CUDA, tree_masks=masks)


# ---- kernels on the device against the host reference ----

@pytest.mark.parametrize("case", list(EXTEND_CASES), ids=list(EXTEND_CASES))
def test_extend_kernel(case):
    q_lens, kv_lens, hq, hkv, d, page_size, dtype, block_m, block_n = EXTEND_CASES[case]
    pool, meta, q = make_batch(q_lens, kv_lens, hq, hkv, d, page_size, dtype)
    gpool, pages, gq = to_device(pool, meta, q)
    gm = gpu_meta(q_lens, kv_lens, pages, page_size)
    out = paged_extend_attention(gq, gpool.k_cache(LAYER), gpool.v_cache(LAYER), gm.qo_indptr, gm.kv_lens,
                                 gm.page_table, d ** -0.5, block_m=block_m, block_n=block_n)
    assert out.device.type == torch.device(CUDA).type and out.dtype == dtype
    torch.testing.assert_close(out.cpu().float(), host_reference(pool, meta, q, d ** -0.5), **TOL[dtype])


@pytest.mark.parametrize("case", list(DECODE_CASES), ids=list(DECODE_CASES))
def test_decode_kernel(case):
    kv_lens, hq, hkv, d, page_size, dtype, num_splits, block_n = DECODE_CASES[case]
    q_lens = [1] * len(kv_lens)
    pool, meta, q = make_batch(q_lens, kv_lens, hq, hkv, d, page_size, dtype)
    gpool, pages, gq = to_device(pool, meta, q)
    gm = gpu_meta(q_lens, kv_lens, pages, page_size)
    out = paged_decode_attention(gq, gpool.k_cache(LAYER), gpool.v_cache(LAYER), gm.kv_lens, gm.page_table,
                                 d ** -0.5, num_splits=num_splits, block_n=block_n)
    torch.testing.assert_close(out.cpu().float(), host_reference(pool, meta, q, d ** -0.5), **TOL[dtype])


@pytest.mark.parametrize("case", list(TREE_CASES), ids=list(TREE_CASES))
def test_tree_extend_kernel(case):
    q_lens, kv_lens, trees, hq, hkv, d, page_size, dtype, block_m, block_n = TREE_CASES[case]
    pool, meta, q, masks = tree_batch(q_lens, kv_lens, trees, hq, hkv, d, page_size, dtype)
    gpool, pages, gq = to_device(pool, meta, q)
    gm = gpu_meta(q_lens, kv_lens, pages, page_size, masks)
    out = paged_extend_attention(gq, gpool.k_cache(LAYER), gpool.v_cache(LAYER), gm.qo_indptr, gm.kv_lens,
                                 gm.page_table, d ** -0.5, block_m=block_m, block_n=block_n,
                                 tree_mask=gm.tree_mask, tree_mask_indptr=gm.tree_mask_indptr)
    assert not out.isnan().any()
    torch.testing.assert_close(out.cpu().float(), host_reference(pool, meta, q, d ** -0.5, tree=True),
                               **TOL[dtype])


# SmolLM2-135M's attention shape at lengths and batches past what the interpreter can run
SMOLLM2 = dict(hq=9, hkv=3, d=64, page_size=16)
LONG_CASES = {
    "decode_b64_ragged_bf16": ([1] * 64, [1 + 67 * i for i in range(64)], None, torch.bfloat16),
    "decode_b8_4k_fp16": ([1] * 8, [4096, 4095, 4097, 16, 17, 2048, 1, 3000], None, torch.float16),
    "prefill_chunks_bf16": ([512, 200, 1, 33], [512, 1700, 900, 33], None, torch.bfloat16),
    "verify_trees_b32_bf16": ([8] * 32, [300 + 31 * i for i in range(32)], ["tree", "shuffled"] * 16,
                              torch.bfloat16),
    "verify_trees_b4_fp32": ([8, 16, 4, 8], [1000, 16, 2049, 64], ["tree", "shuffled", "tree", None],
                             torch.float32),
}


@pytest.mark.parametrize("case", list(LONG_CASES), ids=list(LONG_CASES))
def test_smollm2_shapes_through_the_triton_backend(case):
    q_lens, kv_lens, trees, dtype = LONG_CASES[case]
    s = SMOLLM2
    if trees is None:
        pool, meta, q = make_batch(q_lens, kv_lens, s["hq"], s["hkv"], s["d"], s["page_size"], dtype, seed=3)
        masks = None
    else:
        pool, meta, q, masks = tree_batch(q_lens, kv_lens, trees, s["hq"], s["hkv"], s["d"], s["page_size"],
                                          dtype, seed=3)
    gpool, pages, gq = to_device(pool, meta, q)
    gm = gpu_meta(q_lens, kv_lens, pages, s["page_size"], masks)
    # the backend writes this step's K/V first: write the rows the host pool already holds, unchanged
    k_new = pool.k_cache(LAYER)[meta.write_pages, meta.write_offsets].to(CUDA)
    v_new = pool.v_cache(LAYER)[meta.write_pages, meta.write_offsets].to(CUDA)
    backend = TritonAttentionBackend(gpool, s["hq"], s["d"])
    out = backend.forward(gq, k_new, v_new, LAYER, backend.plan(gm))
    assert torch.equal(gpool.buffer.cpu(), pool.buffer)
    ref = host_reference(pool, meta, q, s["d"] ** -0.5, tree=trees is not None)
    torch.testing.assert_close(out.cpu().float(), ref, **TOL[dtype])


@pytest.mark.parametrize("backend_cls", [TorchAttentionBackend, TritonAttentionBackend], ids=["torch", "triton"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_backends_write_then_attend(backend_cls, dtype):
    hq, hkv, d, page_size = 4, 2, 32, 4
    q_lens, kv_lens = [1, 7, 5, 1], [6, 15, 5, 17]
    pool, meta, q, masks = tree_batch(q_lens, kv_lens, [None, "tree", "shuffled", None], hq, hkv, d, page_size,
                                      dtype, seed=4)
    gen = torch.Generator().manual_seed(9)
    k_new = torch.randn(q.shape[0], hkv, d, generator=gen).to(dtype)
    v_new = torch.randn(q.shape[0], hkv, d, generator=gen).to(dtype)
    pool.k_cache(LAYER)[meta.write_pages, meta.write_offsets] = k_new  # the host reference's pool after the write
    pool.v_cache(LAYER)[meta.write_pages, meta.write_offsets] = v_new
    gpool, pages, gq = to_device(pool, meta, q)
    gm = gpu_meta(q_lens, kv_lens, pages, page_size, masks)
    backend = backend_cls(gpool, hq, d)
    out = backend.forward(gq, k_new.to(CUDA), v_new.to(CUDA), LAYER, backend.plan(gm))
    assert torch.equal(gpool.buffer.cpu(), pool.buffer)
    torch.testing.assert_close(out.cpu().float(), host_reference(pool, meta, q, d ** -0.5, tree=True), **TOL[dtype])


@pytest.mark.parametrize("case", list(KERNEL_CASES), ids=list(KERNEL_CASES))
def test_compact_kernel_bit_exact(case):
    pool, moves = accepted_paths_batch(case)
    expected = pool.buffer.clone()
    compact_kv_ref(expected, *moves)
    buffer = pool.buffer.to(CUDA)
    compact_kv(buffer, *[t.to(CUDA) for t in moves])
    assert torch.equal(buffer.cpu(), expected)


# ---- the engine on the device ----

PROMPTS = [[5, 17, 99, 3], list(range(40, 77)), [7], list(range(100, 113)) * 3]
GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
NUM_PAGES = 256


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    path = tmp_path_factory.mktemp("llama")
    save_tiny_model("llama", path, num_hidden_layers=8)  # EAGLE-3 fuses layers 2, 4, 5
    return str(path)


def engine(path, device, backend, dtype="float32", spec=None, chunk=16):
    return LLMEngine(EngineConfig(model=path, device=device, dtype=dtype, attention_backend=backend,
                                  cache=CacheConfig(page_size=4, num_pages=NUM_PAGES),
                                  scheduler=SchedulerConfig(chunked_prefill_size=chunk),
                                  spec=spec or SpecConfig()))


def run_all(eng, prompts=PROMPTS, params=GREEDY):
    start = eng.free_pages  # with CUDA graphs (the default here) one page is the pad rows' scratch page
    outs = eng.generate(prompts, params)
    assert eng.free_pages == start
    return outs


@pytest.fixture(scope="module")
def cpu_tokens(target):
    return [o.token_ids for o in run_all(engine(target, "cpu", "torch"))]


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_fp32_greedy_on_the_gpu_equals_the_cpu_engine(target, cpu_tokens, backend):
    assert [o.token_ids for o in run_all(engine(target, CUDA, backend))] == cpu_tokens


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_half_precision_backends_agree_on_the_gpu(target, dtype):
    outs = {b: [o.token_ids for o in run_all(engine(target, CUDA, b, dtype))] for b in ("torch", "triton")}
    # different kernels round differently: most tokens agree, and every prompt's first few do
    same = sum(a == b for x, y in zip(outs["torch"], outs["triton"]) for a, b in zip(x, y))
    assert same >= 0.8 * sum(len(x) for x in outs["torch"])


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("algorithm,topk,tokens", [("eagle3", 1, None), ("eagle3", 3, 8), ("eagle", 3, 8),
                                                   ("mtp", 1, None), ("ngram", None, None)])
def test_speculation_is_lossless_on_the_gpu(target, tmp_path, dtype, algorithm, topk, tokens):
    plain = [o.token_ids for o in run_all(engine(target, CUDA, "triton", dtype))]
    draft = None
    if algorithm != "ngram":
        cfg = ModelConfig.from_hf(load_checkpoint(target).hf_config)
        random_draft_checkpoint(str(tmp_path), algorithm, cfg, seed=1)
        draft = str(tmp_path)
    spec = SpecConfig(algorithm, draft_model=draft, spec_num_steps=3, spec_topk=topk,
                      spec_num_draft_tokens=tokens, spec_adaptive_pinned=True)
    outs = run_all(engine(target, CUDA, "triton", dtype, spec=spec))
    assert [o.token_ids for o in outs] == plain
    if algorithm != "ngram":
        assert all(o.spec_verify_count > 0 for o in outs)
