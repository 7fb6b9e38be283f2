"""FlashInfer backend: plan inputs and error paths on CPU; outputs against the torch reference on GPU.

CPU (always): flashinfer_plan_inputs against hand-computed values and against the page table; tree masks as
FlashInfer's custom mask (each sequence's [q_len, kv_len] visibility) against the reference's;
constructing the backend without CUDA, or without flashinfer, fails with a clear error.
CPU, flashinfer installed: FlashInfer's own seq-len helper and wrapper signatures agree with us.
GPU + flashinfer: prefill/mixed and pure-decode batches match paged_attention_ref.
"""
import inspect
import random

import pytest
import torch

from specpd.attention.base import get_backend_class
from specpd.attention.flashinfer_backend import (
    FlashInferAttentionBackend, _import_flashinfer, flashinfer_custom_mask, flashinfer_plan_inputs)
from specpd.attention.metadata import AttentionMetadata
from specpd.attention.reference import paged_attention_ref
from specpd.kv.pool import KVPool
from tests.kernels.test_tree_attention import ancestor_mask, random_parents, shuffled

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="flashinfer kernels need a CUDA GPU")

# Ragged batches on page_size 16: fresh prefills, extends over a prefix, decode rows, lengths on
# page boundaries (16, 32, 48), single-token sequences.
BATCHES = {
    # q_lens, kv_lens, pages per sequence beyond what kv_len needs (scratch)
    "mixed": ([17, 1, 3, 1, 8], [17, 16, 21, 1, 40], [0, 1, 0, 0, 2]),
    "prefill_on_page_boundary": ([16, 32], [16, 48], [0, 0]),
    "decode": ([1, 1, 1, 1], [1, 16, 33, 200], [0, 1, 0, 0]),
}


def _as_lists(inputs):
    return {name: t.tolist() for name, t in inputs.items()}


def test_plan_inputs_ragged_scattered_pages():
    # page_size 4. seq 0: fresh prefill of 5 tokens (one token spills onto a 2nd page);
    # seq 1: decode exactly on a page boundary (kv_len 8) with a reserved scratch page 6 that must
    # not be attended; seq 2: extend of 3 over a prefix, using real page id 0 in the middle;
    # seq 3: single-token sequence.
    meta = AttentionMetadata.build(q_lens=[5, 1, 3, 1], kv_lens=[5, 8, 11, 1],
                                   page_lists=[[7, 2], [3, 9, 6], [5, 0, 10], [4]], page_size=4)
    inputs = flashinfer_plan_inputs(meta)
    assert _as_lists(inputs) == {
        "qo_indptr": [0, 5, 6, 9, 10],
        "paged_kv_indptr": [0, 2, 4, 7, 8],
        "paged_kv_indices": [7, 2, 3, 9, 5, 0, 10, 4],
        "paged_kv_last_page_len": [1, 4, 3, 1],
    }
    assert all(t.dtype == torch.int32 for t in inputs.values())


def test_plan_inputs_every_last_page_full():
    meta = AttentionMetadata.build(q_lens=[1, 1, 16], kv_lens=[4, 12, 16],
                                   page_lists=[[11], [1, 8, 2], [6, 5, 4, 3]], page_size=4)
    assert _as_lists(flashinfer_plan_inputs(meta)) == {
        "qo_indptr": [0, 1, 2, 18],
        "paged_kv_indptr": [0, 1, 4, 8],
        "paged_kv_indices": [11, 1, 8, 2, 6, 5, 4, 3],
        "paged_kv_last_page_len": [4, 4, 4],
    }


def test_plan_inputs_single_token_and_page_size_one():
    meta = AttentionMetadata.build(q_lens=[1], kv_lens=[1], page_lists=[[0]], page_size=16)
    assert _as_lists(flashinfer_plan_inputs(meta)) == {
        "qo_indptr": [0, 1], "paged_kv_indptr": [0, 1],
        "paged_kv_indices": [0], "paged_kv_last_page_len": [1],
    }
    meta = AttentionMetadata.build(q_lens=[2, 1], kv_lens=[3, 2], page_lists=[[9, 4, 7], [2, 5]],
                                   page_size=1)
    assert _as_lists(flashinfer_plan_inputs(meta)) == {
        "qo_indptr": [0, 2, 3], "paged_kv_indptr": [0, 3, 5],
        "paged_kv_indices": [9, 4, 7, 2, 5], "paged_kv_last_page_len": [1, 1],
    }


@pytest.mark.parametrize("seed", range(5))
def test_plan_inputs_cover_exactly_the_kv_positions(seed):
    # Random ragged batches with scattered pages: each sequence's CSR page list is the prefix of
    # its table row that holds kv_len positions, and the pages + last_page_len give back kv_len.
    rng = random.Random(seed)
    page_size = rng.choice([1, 2, 4, 16])
    free = list(range(200))
    rng.shuffle(free)
    q_lens, kv_lens, page_lists = [], [], []
    for _ in range(rng.randint(1, 6)):
        kv_len = rng.randint(1, 40)
        q_lens.append(rng.choice([1, kv_len, rng.randint(1, kv_len)]))
        kv_lens.append(kv_len)
        n = -(-kv_len // page_size) + rng.randint(0, 2)  # sometimes extra scratch pages
        page_lists.append([free.pop() for _ in range(n)])
    meta = AttentionMetadata.build(q_lens, kv_lens, page_lists, page_size)
    inputs = flashinfer_plan_inputs(meta)
    indptr, indices = inputs["paged_kv_indptr"].tolist(), inputs["paged_kv_indices"].tolist()
    last = inputs["paged_kv_last_page_len"].tolist()
    assert inputs["qo_indptr"].tolist() == meta.qo_indptr.tolist()
    for b, kv_len in enumerate(kv_lens):
        n = indptr[b + 1] - indptr[b]
        assert indices[indptr[b]:indptr[b + 1]] == page_lists[b][:n]
        assert 1 <= last[b] <= page_size
        assert (n - 1) * page_size + last[b] == kv_len


def test_plan_inputs_rejects_short_page_table():
    meta = AttentionMetadata.build(q_lens=[1], kv_lens=[4], page_lists=[[3]], page_size=4)
    meta.kv_lens_host = [5]  # needs 2 pages, the table has 1 column
    with pytest.raises(ValueError, match="needs 2 pages"):
        flashinfer_plan_inputs(meta)


def test_backend_without_cuda_raises_clear_error():
    pool = KVPool(num_pages=4, num_layers=1, page_size=4, kv_heads=2, head_dim=8, dtype=torch.float16)
    backend_cls = get_backend_class("flashinfer")  # importable on CPU, with or without flashinfer
    assert backend_cls is FlashInferAttentionBackend
    with pytest.raises(RuntimeError, match="needs a CUDA device; use --attention-backend torch or triton"):
        backend_cls(pool, num_q_heads=4, head_dim=8)


def test_missing_flashinfer_raises_clear_error(monkeypatch):
    monkeypatch.setitem(__import__("sys").modules, "flashinfer", None)
    with pytest.raises(RuntimeError, match="pip install flashinfer-python"):
        _import_flashinfer()


class _FakePagedWrapper:
    """FlashInfer's paged-KV contract in torch: CSR page lists + last_page_len, bottom-right causal.

    Lets the backend's plan/forward wiring (which wrapper, which layer's strided views, write before
    attend, dtypes) run on CPU; the real kernels are checked by the GPU tests below.
    """

    def __init__(self, workspace, kv_layout, **kwargs):
        assert kv_layout == "NHD"

    def plan(self, *args, q_data_type, kv_data_type, sm_scale, causal=None, custom_mask=None):
        if len(args) == 7:  # decode: one query per sequence
            indptr = args[0]
            args = (torch.arange(len(indptr), dtype=torch.int32),) + args
        else:
            assert causal is (custom_mask is None)  # FlashInfer reads a custom mask instead of the causal flag
        self.custom_mask = custom_mask
        self.qo_indptr, self.kv_indptr, self.indices, self.last_page_len = args[:4]
        self.page_size = args[7]
        self.dtypes, self.sm_scale = (q_data_type, kv_data_type), sm_scale

    def run(self, q, paged_kv_cache):
        k_cache, v_cache = paged_kv_cache
        assert (q.dtype, k_cache.dtype) == self.dtypes and k_cache.stride() == v_cache.stride()
        out = torch.empty_like(q)
        qo, kv = self.qo_indptr.tolist(), self.kv_indptr.tolist()
        mask_at = 0
        for b, last in enumerate(self.last_page_len.tolist()):
            pages = self.indices[kv[b]:kv[b + 1]]
            kv_len = (len(pages) - 1) * self.page_size + last
            q_len = qo[b + 1] - qo[b]
            mask = None  # FlashInfer's custom mask: [q_len, kv_len] per sequence, row-major, concatenated
            if self.custom_mask is not None:
                mask, mask_at = self.custom_mask[mask_at:mask_at + q_len * kv_len], mask_at + q_len * kv_len
            out[qo[b]:qo[b + 1]] = paged_attention_ref(
                q[qo[b]:qo[b + 1]], k_cache, v_cache, torch.tensor([0, q_len]), torch.tensor([kv_len]), pages[None],
                self.sm_scale, mask, None if mask is None else torch.tensor([0, mask.numel()]))
        return out


class _FakeDecodeWrapper(_FakePagedWrapper):
    pass


def test_custom_mask_is_each_sequences_visibility():
    """prefix visible, then the tree block over the last positions; a sequence without one causal."""
    tree = torch.tensor([[1, 0, 0], [1, 1, 0], [1, 0, 1]], dtype=torch.bool)
    wide = torch.tensor([[1, 0, 1, 0], [0, 1, 0, 1]], dtype=torch.bool)  # a draft step's [2, 4] block
    meta = AttentionMetadata.build(q_lens=[3, 2, 2], kv_lens=[5, 2, 6], page_lists=[[1, 2], [3], [4, 5]],
                                   page_size=4, tree_masks=[tree, None, wide])
    mask = flashinfer_custom_mask(meta)
    assert mask.dtype == torch.bool and mask.numel() == 3 * 5 + 2 * 2 + 2 * 6
    assert mask[:15].view(3, 5).int().tolist() == [[1, 1, 1, 0, 0], [1, 1, 1, 1, 0], [1, 1, 1, 0, 1]]
    assert mask[15:19].view(2, 2).int().tolist() == [[1, 0], [1, 1]]
    assert mask[19:].view(2, 6).int().tolist() == [[1, 1, 1, 0, 1, 0], [1, 1, 0, 1, 0, 1]]
    assert flashinfer_custom_mask(AttentionMetadata.build([2], [4], [[0]], 4)) is None


@pytest.mark.parametrize("batch", ["mixed", "decode", "trees"])
def test_backend_wiring_with_fake_flashinfer_on_cpu(batch, monkeypatch):
    from types import SimpleNamespace

    from specpd.attention import flashinfer_backend as fib
    fake = SimpleNamespace(BatchPrefillWithPagedKVCacheWrapper=_FakePagedWrapper,
                           BatchDecodeWithPagedKVCacheWrapper=_FakeDecodeWrapper)
    monkeypatch.setattr(fib, "_require_cuda", lambda device: None)
    monkeypatch.setattr(fib, "_import_flashinfer", lambda: fake)
    monkeypatch.setattr(fib, "_kernel_backend", lambda device: "auto")
    monkeypatch.setattr(fib, "WORKSPACE_BYTES", 16)
    q_lens, kv_lens, _ = BATCHES["mixed" if batch == "trees" else batch]
    page_size, q_heads, kv_heads, head_dim, num_layers = 16, 4, 2, 8, 2
    gen = torch.Generator().manual_seed(0)
    pool = KVPool(num_pages=40, num_layers=num_layers, page_size=page_size, kv_heads=kv_heads,
                  head_dim=head_dim, dtype=torch.float16)
    pool.buffer.copy_(torch.randn(pool.buffer.shape, generator=gen))
    free = torch.randperm(40, generator=gen).tolist()
    page_lists = [[free.pop() for _ in range(-(-kv // page_size) + 1)] for kv in kv_lens]
    backend = FlashInferAttentionBackend(pool, num_q_heads=q_heads, head_dim=head_dim)
    masks = None
    if batch == "trees":  # verify trees (nodes out of order) beside a decode row and a causal extend
        masks = [shuffled(ancestor_mask(random_parents(q, gen)), gen) if q > 2 else None for q in q_lens]
    meta = backend.plan(AttentionMetadata.build(q_lens, kv_lens, page_lists, page_size, tree_masks=masks))
    assert isinstance(meta.plan.wrapper, _FakeDecodeWrapper) == (batch == "decode")
    for layer in range(num_layers):
        q = torch.randn(sum(q_lens), q_heads, head_dim, generator=gen)  # fp32 in, fp16 pool
        k, v = (torch.randn(sum(q_lens), kv_heads, head_dim, generator=gen) for _ in range(2))
        out = backend.forward(q, k, v, layer, meta)
        assert out.dtype == torch.float32
        torch.testing.assert_close(pool.k_cache(layer)[meta.write_pages, meta.write_offsets], k.half())
        ref = paged_attention_ref(q.half(), pool.k_cache(layer), pool.v_cache(layer), meta.qo_indptr,
                                  meta.kv_lens, meta.page_table, backend.sm_scale, meta.tree_mask,
                                  meta.tree_mask_indptr)
        torch.testing.assert_close(out, ref.float())


def test_flashinfer_agrees_with_plan_inputs_on_cpu():
    page = pytest.importorskip("flashinfer.page", reason="flashinfer-python not installed")
    meta = AttentionMetadata.build(q_lens=[5, 1, 3, 1], kv_lens=[5, 8, 11, 1],
                                   page_lists=[[7, 2], [3, 9, 6], [5, 0, 10], [4]], page_size=4)
    inputs = flashinfer_plan_inputs(meta)
    seq_lens = page.get_seq_lens(inputs["paged_kv_indptr"], inputs["paged_kv_last_page_len"], 4)
    assert seq_lens.tolist() == meta.kv_lens_host


def test_flashinfer_wrapper_signatures():
    flashinfer = pytest.importorskip("flashinfer", reason="flashinfer-python not installed")
    prefill = inspect.signature(flashinfer.BatchPrefillWithPagedKVCacheWrapper.plan).parameters
    assert list(prefill)[1:9] == ["qo_indptr", "paged_kv_indptr", "paged_kv_indices", "paged_kv_last_page_len",
                                  "num_qo_heads", "num_kv_heads", "head_dim_qk", "page_size"]
    assert {"causal", "sm_scale", "q_data_type", "kv_data_type"} <= set(prefill)
    decode_cls = flashinfer.BatchDecodeWithPagedKVCacheWrapper
    decode = inspect.signature(getattr(decode_cls, "_plan_impl", decode_cls.plan)).parameters
    assert list(decode)[1:8] == ["indptr", "indices", "last_page_len", "num_qo_heads", "num_kv_heads",
                                 "head_dim", "page_size"]
    assert {"sm_scale", "q_data_type", "kv_data_type"} <= set(decode)


# ---- GPU: the backend against the torch reference ----

def _run_batch(q_lens, kv_lens, extra_pages, dtype, q_heads=8, kv_heads=2, head_dim=64,
               page_size=16, num_layers=3, seed=0, trees=False):
    gen = torch.Generator().manual_seed(seed)
    dev = "cuda"
    pool = KVPool(num_pages=64, num_layers=num_layers, page_size=page_size, kv_heads=kv_heads,
                  head_dim=head_dim, dtype=dtype, device=dev)
    free = torch.randperm(64, generator=gen).tolist()
    page_lists = [[free.pop() for _ in range(-(-kv // page_size) + extra)]
                  for kv, extra in zip(kv_lens, extra_pages)]
    # Prefix KV (positions before this step's queries) already sits in the pool, every layer.
    pool.buffer.copy_(torch.randn(pool.buffer.shape, generator=gen).to(dtype))
    backend = FlashInferAttentionBackend(pool, num_q_heads=q_heads, head_dim=head_dim)
    masks = [shuffled(ancestor_mask(random_parents(q, gen)), gen) if trees and q > 1 else None for q in q_lens]
    meta = backend.plan(AttentionMetadata.build(q_lens, kv_lens, page_lists, page_size, device=dev,
                                                tree_masks=masks))
    num_tokens = sum(q_lens)
    for layer in range(num_layers):
        q = torch.randn(num_tokens, q_heads, head_dim, generator=gen).to(dev, dtype)
        k = torch.randn(num_tokens, kv_heads, head_dim, generator=gen).to(dev, dtype)
        v = torch.randn(num_tokens, kv_heads, head_dim, generator=gen).to(dev, dtype)
        out = backend.forward(q, k, v, layer, meta)
        ref = paged_attention_ref(q.cpu(), pool.k_cache(layer).cpu(), pool.v_cache(layer).cpu(),
                                  meta.qo_indptr.cpu(), meta.kv_lens.cpu(), meta.page_table.cpu(),
                                  backend.sm_scale, None if meta.tree_mask is None else meta.tree_mask.cpu(),
                                  None if meta.tree_mask is None else meta.tree_mask_indptr.cpu())
        tol = 2e-2 if dtype == torch.bfloat16 else 3e-3
        torch.testing.assert_close(out.cpu().float(), ref.float(), atol=tol, rtol=tol)
    return backend, meta


@needs_cuda
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("batch", list(BATCHES))
def test_matches_reference_on_gpu(batch, dtype):
    pytest.importorskip("flashinfer", reason="flashinfer-python not installed")
    backend, meta = _run_batch(*BATCHES[batch], dtype)
    expected = backend._decode if batch == "decode" else backend._prefill
    assert meta.plan.wrapper is expected


@needs_cuda
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_tree_masks_match_reference_on_gpu(dtype):
    pytest.importorskip("flashinfer", reason="flashinfer-python not installed")
    backend, meta = _run_batch([17, 1, 3, 1, 8], [17, 16, 21, 1, 40], [0, 1, 0, 0, 2], dtype, trees=True)
    assert meta.plan.wrapper is backend._prefill and meta.tree_mask is not None


@needs_cuda
def test_stale_plan_and_float32_pool_rejected_on_gpu():
    pytest.importorskip("flashinfer", reason="flashinfer-python not installed")
    pool = KVPool(num_pages=8, num_layers=1, page_size=4, kv_heads=2, head_dim=64, dtype=torch.float32,
                  device="cuda")
    with pytest.raises(RuntimeError, match="float16 or bfloat16"):
        FlashInferAttentionBackend(pool, num_q_heads=4, head_dim=64)
    pool = KVPool(num_pages=8, num_layers=1, page_size=4, kv_heads=2, head_dim=64, dtype=torch.float16,
                  device="cuda")
    backend = FlashInferAttentionBackend(pool, num_q_heads=4, head_dim=64)
    first = backend.plan(AttentionMetadata.build([1], [3], [[2]], 4, device="cuda"))
    backend.plan(AttentionMetadata.build([2], [2], [[5]], 4, device="cuda"))
    q = torch.randn(1, 4, 64, device="cuda", dtype=torch.float16)
    kv = torch.randn(1, 2, 64, device="cuda", dtype=torch.float16)
    with pytest.raises(RuntimeError, match="call plan"):
        backend.forward(q, kv, kv, 0, first)
