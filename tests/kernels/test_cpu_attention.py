"""The CPU paged attention kernel (specpd/kernels/cpu_attention.py) against its torch reference, and the cpu
backend against the torch backend.

Every case uses a real 3-layer KVPool (the layer's K/V are strided views inside each page) with page tables drawn
from a shuffled page list (a sequence's pages scattered and out of order); ragged batches mix decode rows, verify
blocks, fresh prefills and extends after a cached prefix, with lengths at and one past page boundaries; trees
use masks wider than their rows (draft steps) and exactly their rows (verify). RoPE on and off, MHA and GQA,
fp32 / fp16 / bf16."""
from __future__ import annotations

import pytest
import torch

from specpd.attention.metadata import AttentionMetadata
from specpd.attention.reference import fused_attention_ref as attention_ref
from specpd.kernels.build import attention_amx_wanted, attention_dp_wanted
from specpd.kernels.cpu_attention import _lib, available, paged_attention
from specpd.kv.pool import KVPool
from specpd.machine import isa

pytestmark = pytest.mark.skipif(not available(), reason="no C compiler: the cpu attention kernel cannot be built")
AMX = available() and isa() == "amx"


@pytest.fixture(params=["vector", "amx", "dp"])
def path(request):
    """The kernel's path for a bf16 test: the AVX-512 / portable one, AMX tiles (where the CPU has them), or
    vdpbf16ps pair dots (where it has AVX512-BF16)."""
    if request.param != "vector" and request.node.callspec.params.get("dtype", torch.bfloat16) != torch.bfloat16:
        pytest.skip(f"the {request.param} path takes bf16 pools only")
    if request.param == "amx" and not AMX:
        pytest.skip("no AMX here")
    lib = _lib()
    amx_on = lib.specpd_attention_use_amx(int(request.param == "amx")) == 1
    dp_on = lib.specpd_attention_use_dp(int(request.param == "dp")) == 1
    try:
        if request.param == "amx" and not amx_on:
            pytest.skip("this build of the kernel has no AMX path (an x86-64-v3 build)")
        if request.param == "dp" and not dp_on:
            pytest.skip("this build of the kernel has no AVX512-BF16 path")
        yield request.param
    finally:
        lib.specpd_attention_use_amx(int(lib.attention_amx))
        lib.specpd_attention_use_dp(int(lib.attention_dp))

LAYER = 1
TOL = {torch.float32: dict(atol=2e-5, rtol=2e-5), torch.float16: dict(atol=2e-3, rtol=2e-3),
       torch.bfloat16: dict(atol=2e-2, rtol=2e-2)}


def rope_tables(max_pos: int, d: int) -> tuple[torch.Tensor, torch.Tensor]:
    inv = 1.0 / (10000 ** (torch.arange(0, d, 2).float() / d))
    emb = torch.cat([torch.outer(torch.arange(max_pos).float(), inv)] * 2, dim=-1)
    return emb.cos(), torch.cat([-emb[:, :d // 2].sin(), emb[:, d // 2:].sin()], dim=-1)


def make_case(q_lens, kv_lens, hq, hkv, d, page_size, dtype, tree_extra=None, seed=0):
    """(pool, meta, qkv [T, hq + 2 hkv, D], positions [T]); tree_extra[b]: None (causal) or the extra width of
    sequence b's tree block beyond its rows (0 = a verify tree)."""
    gen = torch.Generator().manual_seed(seed)
    pages_per_seq = [-(-kv // page_size) for kv in kv_lens]
    num_pages = sum(pages_per_seq) + 3
    pool = KVPool(num_pages, 3, page_size, hkv, d, dtype)
    pool.buffer.copy_(torch.randn(pool.buffer.shape, generator=gen) * 0.7)
    perm = torch.randperm(num_pages, generator=gen).tolist()
    page_lists, used = [], 0
    for n in pages_per_seq:
        page_lists.append(perm[used:used + n])
        used += n
    trees = None
    if tree_extra is not None:
        trees = []
        for q, extra in zip(q_lens, tree_extra):
            if extra is None:
                trees.append(None)
                continue
            m = torch.rand(q, q + extra, generator=gen) < 0.5
            m[:, extra:] |= torch.eye(q, dtype=torch.bool)
            trees.append(m)
    meta = AttentionMetadata.build(q_lens, kv_lens, page_lists, page_size, tree_masks=trees)
    qkv = torch.randn(sum(q_lens), hq + 2 * hkv, d, generator=gen).to(dtype)
    positions = torch.tensor([kv - q + j for q, kv in zip(q_lens, kv_lens) for j in range(q)], dtype=torch.int64)
    return pool, meta, qkv, positions


def run(fn, pool, meta, qkv, positions, hq, hkv, rope=True):
    d = qkv.shape[-1]
    cos, sin = rope_tables(4096, d) if rope else (None, None)
    slots = meta.write_pages * meta.page_size + meta.write_offsets
    return fn(qkv[:, :hq], positions, qkv[:, hq:hq + hkv], qkv[:, hq + hkv:], positions, slots, cos, sin,
              pool.buffer, LAYER, meta.qo_indptr, meta.kv_lens, meta.page_table, meta.tree_mask,
              meta.tree_mask_indptr, hq, d ** -0.5)


CASES = {  # q_lens, kv_lens, Hq, Hkv, D, page_size, tree_extra
    "decode_gqa3_p16": ([1, 1, 1, 1], [300, 17, 16, 1], 9, 3, 64, 16, None),
    "ragged_mixed_p16": ([5, 8, 1, 40, 20], [300, 33, 16, 40, 50], 9, 3, 64, 16, None),
    "page1_mha": ([2, 5, 1], [19, 5, 7], 2, 2, 16, 1, None),
    "boundaries_p4": ([16, 1, 7, 33], [16, 17, 32, 33], 6, 2, 32, 4, None),
    "long_prefill_rows_cross_blocks": ([70, 3], [130, 64], 4, 1, 64, 64, None),
    "verify_trees": ([8, 5, 1], [60, 5, 33], 9, 3, 64, 16, [0, 0, None]),
    "draft_step_trees": ([4, 3, 2], [40, 19, 9], 8, 2, 64, 4, [5, 2, 0]),
    "head_dim128": ([3, 1], [20, 70], 8, 1, 128, 16, None),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("rope", [True, False], ids=["rope", "no_rope"])
def test_kernel_matches_reference(name, dtype, rope, path):
    q_lens, kv_lens, hq, hkv, d, ps, tree = CASES[name]
    pool, meta, qkv, positions = make_case(q_lens, kv_lens, hq, hkv, d, ps, dtype, tree)
    ref_pool = KVPool(pool.num_pages, 3, ps, hkv, d, dtype)
    ref_pool.buffer.copy_(pool.buffer)
    out = run(paged_attention, pool, meta, qkv, positions, hq, hkv, rope)
    want = run(attention_ref, ref_pool, meta, qkv, positions, hq, hkv, rope)
    torch.testing.assert_close(out.float(), want.float(), **TOL[dtype])
    # the new K/V landed where the reference put them (a rounding of RoPE's fp32 result at most), nothing else moved
    torch.testing.assert_close(pool.buffer.float(), ref_pool.buffer.float(), **TOL[dtype])
    untouched = torch.ones(pool.num_pages, dtype=torch.bool)
    untouched[meta.page_table.flatten().long()] = False
    assert torch.equal(pool.buffer[untouched], ref_pool.buffer[untouched])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_a_row_does_not_depend_on_its_batch(dtype, path):
    """A verify block's rows, and the same rows decoded one at a time over the same prefix: bit for bit."""
    q_lens, kv_lens = [7], [100]
    pool, meta, qkv, positions = make_case(q_lens, kv_lens, 9, 3, 64, 16, dtype)
    together = run(paged_attention, pool, meta, qkv, positions, 9, 3)
    pages = meta.page_table[0].tolist()
    for j in range(7):
        one = AttentionMetadata.build([1], [kv_lens[0] - 6 + j], [pages], 16)
        alone = run(paged_attention, pool, one, qkv[j:j + 1], positions[j:j + 1], 9, 3)
        assert torch.equal(alone, together[j:j + 1]), j


TREE_PARENTS = [-1, 0, 0, 1, 1, 2, 3, 5]  # depths 0 1 1 2 2 2 3 3: nodes in their siblings' slots


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("prefix", [60, 100, 32])  # the tree's slots across a chunk boundary, inside one, at one
def test_a_tree_row_equals_the_decode_step_over_its_path(dtype, prefix, path):
    """A tree verify's node j sits in slot prefix + j while its position is prefix + depth(j): it must compute
    what a decode row at that position computes over the same keys (its ancestors in consecutive positions), bit
    for bit. Reading keys by slot, a node in a sibling's slot summed its softmax lanes in another order: a bf16
    EAGLE server's greedy output diverged from plain decoding (issue 32's exactness)."""
    n = len(TREE_PARENTS)
    depth, paths = [], []
    for j, par in enumerate(TREE_PARENTS):
        depth.append(0 if par < 0 else depth[par] + 1)
        paths.append(([] if par < 0 else paths[par]) + [j])
    mask = torch.zeros(n, n, dtype=torch.bool)
    for j, path in enumerate(paths):
        mask[j, path] = True
    pool, meta, qkv, _ = make_case([n], [prefix + n], 9, 3, 64, 16, dtype, seed=3)
    meta = AttentionMetadata.build([n], [prefix + n], [meta.page_table[0].tolist()], 16, tree_masks=[mask])
    positions = torch.tensor([prefix + d for d in depth])
    together = run(paged_attention, pool, meta, qkv, positions, 9, 3)  # writes the nodes' K/V at their slots
    pages = meta.page_table[0].tolist()
    for j, path in enumerate(paths):
        alone_pool = KVPool(pool.num_pages, 3, 16, 3, 64, dtype)
        alone_pool.buffer.copy_(pool.buffer)
        for t, node in enumerate(path):  # the path's K/V in consecutive positions, as decoding it wrote them
            src, dst = prefix + node, prefix + t
            alone_pool.buffer[pages[dst // 16], LAYER, :, dst % 16] = pool.buffer[pages[src // 16], LAYER, :, src % 16]
        one = AttentionMetadata.build([1], [prefix + depth[j] + 1], [pages], 16)
        alone = run(paged_attention, alone_pool, one, qkv[j:j + 1], positions[j:j + 1], 9, 3)
        assert torch.equal(alone, together[j:j + 1]), (j, depth[j])


def _rounds_apart_from_the_vector_path(setter) -> None:
    """The process's bf16 path, then the fp32 vector path (`setter(0)`) on the same case: some outputs differ."""
    q_lens, kv_lens, hq, hkv, d, ps, tree = CASES["verify_trees"]
    pool, meta, qkv, positions = make_case(q_lens, kv_lens, hq, hkv, d, ps, torch.bfloat16, tree)
    before = pool.buffer.clone()
    fast = run(paged_attention, pool, meta, qkv, positions, hq, hkv)
    try:
        setter(0)
        pool.buffer.copy_(before)
        assert not torch.equal(fast, run(paged_attention, pool, meta, qkv, positions, hq, hkv))
    finally:
        setter(1)


@pytest.mark.skipif(not (AMX and attention_amx_wanted()), reason="no AMX here, or SPECPD_ATTENTION_AMX=0")
def test_an_amx_cpu_attends_bf16_on_tiles_and_they_round_apart_from_the_vector_path():
    """The process attends bf16 on tiles where the CPU has AMX (build.attention_amx_wanted), and the switch reaches
    another computation: the two paths round some outputs apart (both are checked against the reference above)."""
    lib = _lib()
    assert lib.attention_amx
    _rounds_apart_from_the_vector_path(lib.specpd_attention_use_amx)


@pytest.mark.skipif(not (available() and isa() == "avx512_bf16" and attention_dp_wanted()),
                    reason="not an AVX512-BF16 CPU without AMX, or SPECPD_ATTENTION_DP=0")
def test_an_avx512_bf16_cpu_attends_bf16_on_pair_dots_and_they_round_apart_from_the_vector_path():
    """Without AMX, a CPU with AVX512-BF16 attends bf16 on vdpbf16ps pair dots (build.attention_dp_wanted), and the
    switch reaches another computation: Q and P rounded to bf16 round some outputs apart from the fp32 vector path
    (both are checked against the reference above)."""
    lib = _lib()
    assert lib.attention_dp and not lib.attention_amx
    _rounds_apart_from_the_vector_path(lib.specpd_attention_use_dp)


def test_bad_shapes_are_refused():
    pool, meta, qkv, positions = make_case([1], [5], 4, 2, 16, 4, torch.float32)
    with pytest.raises(ValueError, match="bfloat16"):
        run(paged_attention, pool, meta, qkv.to(torch.bfloat16), positions, 4, 2)
    with pytest.raises(ValueError, match="unsupported shape"):
        run(paged_attention, pool, meta, torch.randn(1, 3 + 4, 16), positions, 3, 2)  # Hq not a multiple of Hkv


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_cpu_backend_matches_torch_backend(dtype):
    """The model-facing path: `attend` (fused RoPE and KV write, rows subset included) against the torch
    backend's rotate-write-attend on the same pools."""
    from specpd.attention.cpu_backend import CpuAttentionBackend
    from specpd.attention.torch_backend import TorchAttentionBackend
    from specpd.config import ModelConfig
    from specpd.model.llama import OutputRows, Rotary, apply_rope
    hq, hkv, d = 6, 2, 32
    cfg = ModelConfig("llama", 100, hq * d, 64, 2, hq, hkv, d)
    rotary = Rotary(cfg, 512)
    q_lens, kv_lens = [3, 1, 6], [40, 17, 6]
    pool, meta, qkv, positions = make_case(q_lens, kv_lens, hq, hkv, d, 4, dtype, [0, None, None])
    ref_pool = KVPool(pool.num_pages, 3, 4, hkv, d, dtype)
    ref_pool.buffer.copy_(pool.buffer)
    cpu, ref = CpuAttentionBackend(pool, hq, d), TorchAttentionBackend(ref_pool, hq, d)
    rope = rotary.table(positions)
    rows_index = torch.tensor([2, 3, 9])  # each sequence's last row
    rows_meta = AttentionMetadata.build([1, 1, 1], kv_lens, [meta.page_table[b, :-(-kv // 4)].tolist()
                                                             for b, kv in enumerate(kv_lens)], 4)
    for rows in (None, OutputRows(rows_index, rows_meta)):
        cpu.plan(meta)
        if rows is not None:
            cpu.plan(rows_meta)
        out = cpu.attend(qkv, rope, LAYER, meta, rows)  # (a plan lives on the metadata: the torch one's follows)
        qk = apply_rope(qkv[:, :hq + hkv].float(), *rope.per_token(torch.float32)).to(dtype)
        q, k, v = qk[:, :hq], qk[:, hq:], qkv[:, hq + hkv:]
        if rows is not None:
            ref_pool.write(LAYER, k, v, meta.write_pages, meta.write_offsets)
            q, k, v, m = q[rows_index], k[rows_index], v[rows_index], rows_meta
        else:
            m = meta
        ref.plan(m)
        want = ref.forward(q, k, v, LAYER, m).reshape(out.shape)
        torch.testing.assert_close(out.float(), want.float(), **TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_long_prompt_chunks_take_sdpa_and_the_other_rows_stay_bit_exact(dtype):
    """Half precision: a large prompt chunk (rows x keys past the threshold) attends through torch's SDPA beside
    a decode row and a short extend in one step. Its rows match the reference; the pool after the step is the
    kernel's write; the decode and extend rows are bit for bit what the kernel gives them without the chunk."""
    from specpd.attention.cpu_backend import PREFILL_SDPA_ROWS, PREFILL_SDPA_WORK, CpuAttentionBackend
    from specpd.config import ModelConfig
    from specpd.model.llama import Rotary
    hq, hkv, d, ps = 9, 3, 64, 16
    cfg = ModelConfig("llama", 100, hq * d, 64, 2, hq, hkv, d)
    rope_of = Rotary(cfg, 4096).table
    n = -(-PREFILL_SDPA_WORK // PREFILL_SDPA_ROWS)  # keys that make a chunk of the fewest rows count
    q_lens = [1, 400, 5, PREFILL_SDPA_ROWS, PREFILL_SDPA_ROWS]
    kv_lens = [40, 430, 21, n, n - 1]  # a fresh 400-token prompt's chunk, the smallest chunk that counts, one less
    pool, meta, qkv, positions = make_case(q_lens, kv_lens, hq, hkv, d, ps, dtype)
    before = pool.buffer.clone()
    backend = CpuAttentionBackend(pool, hq, d)
    backend.plan(meta)
    starts = meta.qo_indptr.tolist()
    assert [(c.start, c.end) for c in meta.plan.long] == [(starts[1], starts[2]), (starts[3], starts[4])]
    assert meta.plan.short_index.tolist() == [0, *range(starts[2], starts[3]), *range(starts[4], starts[5])]
    out = backend.attend(qkv, rope_of(positions), LAYER, meta)
    # the reference on a copy of the pool as it was: K/V written the same, every row within tolerance
    ref_pool = KVPool(pool.num_pages, 3, ps, hkv, d, dtype)
    ref_pool.buffer.copy_(before)
    rope = rope_of(positions)
    want = attention_ref(qkv[:, :hq], positions, qkv[:, hq:hq + hkv], qkv[:, hq + hkv:], positions,
                         meta.write_pages * ps + meta.write_offsets, rope.cos, rope.signed_sin, ref_pool.buffer, LAYER,
                         meta.qo_indptr, meta.kv_lens, meta.page_table, None, None, hq, d ** -0.5)
    torch.testing.assert_close(out.float(), want.float(), **TOL[dtype])
    kernel_pool = KVPool(pool.num_pages, 3, ps, hkv, d, dtype)
    kernel_pool.buffer.copy_(before)
    alone = paged_attention(qkv[:, :hq], positions, qkv[:, hq:hq + hkv], qkv[:, hq + hkv:], positions,
                            meta.write_pages * ps + meta.write_offsets, rope.cos, rope.signed_sin, kernel_pool.buffer,
                            LAYER, meta.qo_indptr, meta.kv_lens, meta.page_table, None, None, hq, d ** -0.5)
    assert torch.equal(pool.buffer, kernel_pool.buffer)
    short = meta.plan.short_index
    assert torch.equal(out[short], alone[short])
    # fp32 pools and chunks of few rows keep the kernel for every row
    for q_len, kv_len, dt in ((400, 400, torch.float32), (PREFILL_SDPA_ROWS - 1, 10 * n, dtype)):
        p2, m2, _, _ = make_case([q_len], [kv_len], hq, hkv, d, ps, dt)
        CpuAttentionBackend(p2, hq, d).plan(m2)
        assert not m2.plan.long


def test_the_avx2_build_matches_the_reference_too():
    """The portable path (no AVX-512: AMD / older Intel boxes) built for x86-64-v3 and run in a child process on
    the same cases as above, where this CPU can run it."""
    import os
    import subprocess
    import sys

    from specpd.machine import cpu_flags
    if not {"avx2", "fma", "f16c"} <= cpu_flags():
        pytest.skip("this CPU cannot run an x86-64-v3 build")
    env = {**os.environ, "SPECPD_KERNEL_MARCH": "x86-64-v3"}
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__, "-k",
                           "matches_reference or does_not_depend", "-x"], env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert " passed" in proc.stdout
