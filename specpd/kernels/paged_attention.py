"""Triton paged attention over the page-major KV pool: ragged extend/prefill and split-K decode.

The torch reference is `specpd.attention.reference.paged_attention_ref`; tests compare against it.

Conventions (same as the reference and `AttentionMetadata`):
- q [num_tokens, Hq, D]: the queries of all sequences concatenated, sequence b owns rows
  qo_indptr[b]:qo_indptr[b+1]. Query j of sequence b sits at position kv_len - q_len + j and sees
  KV positions <= its own (causal with a prefix offset). The KV of this step's tokens is already in
  the cache when these kernels run.
- Tree masks (extend only): tree_mask [total] bool holds, for each sequence b with
  tree_mask_indptr[b+1] > tree_mask_indptr[b], a row-major [q_len, width] block (width >= q_len,
  width = block size / q_len) over the last `width` KV positions; query j sees every position before
  them and position kv_len - width + i iff block[j, i]. Verify uses width == q_len (the tree's own
  nodes); tree drafting uses a wider block to also see earlier draft steps' scratch slots. Sequences
  with an empty block stay causal. Without a mask the kernel is compiled with TREE=False and the
  causal path is unchanged.
- k_cache / v_cache [num_pages, page_size, Hkv, D]: the per-layer views of the pool. They are
  strided (page stride = num_layers * 2 * page_size * Hkv * D), so the kernels take all four
  strides and never copy the cache. Position p of sequence b lives in page page_table[b, p // page_size],
  slot p % page_size; the kernels gather per position, so any power-of-two page size works.
- GQA: q head h reads kv head h // (Hq // Hkv).

Math is fp32 (online softmax in base 2). Under TRITON_INTERPRET=1 the dot operands are cast to fp32,
because the interpreter's bf16 dot is wrong; on GPU fp16/bf16 operands go to tensor cores and fp32
operands use IEEE (not TF32) precision. head_dim need not be a power of two: it is padded to
BLOCK_D >= 16 with masks (16 is the smallest tl.dot size on GPU).
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

LOG2E = 1.4426950408889634


@triton.jit
def _extend_kernel(
    Q, K, V, Out, QoIndptr, KvLens, PageTable,
    TreeMask, TreeMaskIndptr,  # read only when TREE
    sm_scale_log2,  # sm_scale * log2(e)
    stride_qt, stride_qh, stride_qd,
    stride_ot, stride_oh, stride_od,
    stride_kp, stride_ks, stride_kh, stride_kd,
    stride_vp, stride_vs, stride_vh, stride_vd,
    stride_pt,
    HEAD_DIM: tl.constexpr, GROUP: tl.constexpr, PAGE_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    DOT_FP32: tl.constexpr, DOT_PRECISION: tl.constexpr, TREE: tl.constexpr,
):
    """Grid (q blocks of the longest sequence, batch, Hq): BLOCK_M queries of one sequence, one head."""
    m_block = tl.program_id(0)
    seq = tl.program_id(1)
    head = tl.program_id(2)
    kv_head = head // GROUP

    q_start = tl.load(QoIndptr + seq)
    q_len = tl.load(QoIndptr + seq + 1) - q_start
    if m_block * BLOCK_M >= q_len:
        return
    kv_len = tl.load(KvLens + seq)
    prefix = kv_len - q_len  # position of query 0

    offs_m = m_block * BLOCK_M + tl.arange(0, BLOCK_M)  # [BLOCK_M] query index within the sequence
    offs_d = tl.arange(0, BLOCK_D)
    m_mask = offs_m < q_len
    d_mask = offs_d < HEAD_DIM
    q_pos = prefix + offs_m  # [BLOCK_M]

    q_ptrs = Q + (q_start + offs_m)[:, None] * stride_qt + head * stride_qh + offs_d[None, :] * stride_qd
    q = tl.load(q_ptrs, mask=m_mask[:, None] & d_mask[None, :], other=0.0)  # [BLOCK_M, BLOCK_D]
    if DOT_FP32:
        q = q.to(tl.float32)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)  # running max (log2 units)
    l_i = tl.zeros([BLOCK_M], tl.float32)  # running sum of exp2
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)

    # the last real query of this block sees positions < kv_end; nothing past it is read
    kv_end = tl.minimum(kv_len, prefix + (m_block + 1) * BLOCK_M)
    if TREE:
        tree_start = tl.load(TreeMaskIndptr + seq)
        tree_size = tl.load(TreeMaskIndptr + seq + 1) - tree_start  # q_len * width, or 0 for a causal sequence
        has_tree = tree_size > 0
        tree_width = tree_size // tl.maximum(q_len, 1)
        tree_base = kv_len - tree_width  # first KV position the block covers
        # a tree row may see any new token, also ones after its own (nodes need not be topologically ordered)
        kv_end = tl.where(has_tree, kv_len, kv_end)
    for start_n in range(0, kv_end, BLOCK_N):
        k_pos = start_n + tl.arange(0, BLOCK_N)  # [BLOCK_N]
        n_mask = k_pos < kv_end
        page = tl.load(PageTable + seq * stride_pt + k_pos // PAGE_SIZE, mask=n_mask, other=0).to(tl.int64)
        slot = k_pos % PAGE_SIZE
        kv_mask = n_mask[:, None] & d_mask[None, :]
        k_ptrs = K + page[:, None] * stride_kp + slot[:, None] * stride_ks + kv_head * stride_kh \
            + offs_d[None, :] * stride_kd
        k = tl.load(k_ptrs, mask=kv_mask, other=0.0).to(q.dtype)  # [BLOCK_N, BLOCK_D]

        qk = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * sm_scale_log2  # [BLOCK_M, BLOCK_N]
        visible = k_pos[None, :] <= q_pos[:, None]  # [BLOCK_M, BLOCK_N]
        if TREE:
            node = k_pos - tree_base  # [BLOCK_N] column of each key in the block, < 0 before it
            entry = offs_m[:, None] * tree_width + node[None, :]  # [BLOCK_M, BLOCK_N] index into the block
            in_block = m_mask[:, None] & (node[None, :] >= 0) & n_mask[None, :] & (entry < tree_size)
            tree_bits = tl.load(TreeMask + tree_start + entry, mask=in_block, other=0) != 0
            visible = tl.where(has_tree, (node[None, :] < 0) | tree_bits, visible)
        qk = tl.where(visible & n_mask[None, :], qk, float("-inf"))

        # causal: every row sees position 0 in the first block, so m_new is finite from then on
        m_new = tl.maximum(m_i, tl.max(qk, axis=1))
        m_exp = m_new
        if TREE:
            # with no prefix a tree row may see nothing in the first blocks: keep exp2 off -inf - -inf
            m_exp = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_exp)
        p = tl.exp2(qk - m_exp[:, None])  # [BLOCK_M, BLOCK_N]
        l_i = l_i * alpha + tl.sum(p, axis=1)

        v_ptrs = V + page[:, None] * stride_vp + slot[:, None] * stride_vs + kv_head * stride_vh \
            + offs_d[None, :] * stride_vd
        v = tl.load(v_ptrs, mask=kv_mask, other=0.0)  # [BLOCK_N, BLOCK_D]
        if DOT_FP32:
            v = v.to(tl.float32)
        else:
            v = v.to(Q.dtype.element_ty)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new

    if TREE:
        l_i = tl.where(l_i > 0, l_i, 1.0)  # padding rows of a prefix-less tree saw nothing; they are not stored
    out = acc / l_i[:, None]
    o_ptrs = Out + (q_start + offs_m)[:, None] * stride_ot + head * stride_oh + offs_d[None, :] * stride_od
    tl.store(o_ptrs, out.to(Out.dtype.element_ty), mask=m_mask[:, None] & d_mask[None, :])


@triton.jit
def _decode_split_kernel(
    Q, K, V, PartialOut, PartialLse, KvLens, PageTable,
    sm_scale_log2,
    split_len,  # KV positions per split, a multiple of BLOCK_N
    stride_qt, stride_qh, stride_qd,
    stride_kp, stride_ks, stride_kh, stride_kd,
    stride_vp, stride_vs, stride_vh, stride_vd,
    stride_pt,
    stride_pob, stride_poh, stride_pos,  # PartialOut [B, Hq, num_splits, BLOCK_D], last dim contiguous
    stride_plb, stride_plh,  # PartialLse [B, Hq, num_splits], last dim contiguous
    HEAD_DIM: tl.constexpr, GROUP: tl.constexpr, PAGE_SIZE: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    DOT_FP32: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    """Grid (batch, Hkv, num_splits): the GROUP q heads sharing one kv head, over one KV chunk.

    Writes the chunk's normalized output and its log2-sum-exp2; `_decode_reduce_kernel` merges chunks.
    """
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)

    offs_h = tl.arange(0, BLOCK_H)  # [BLOCK_H] q head within the group
    offs_d = tl.arange(0, BLOCK_D)
    h_mask = offs_h < GROUP
    d_mask = offs_d < HEAD_DIM
    heads = kv_head * GROUP + offs_h

    q_ptrs = Q + seq * stride_qt + heads[:, None] * stride_qh + offs_d[None, :] * stride_qd
    q = tl.load(q_ptrs, mask=h_mask[:, None] & d_mask[None, :], other=0.0)  # [BLOCK_H, BLOCK_D]
    if DOT_FP32:
        q = q.to(tl.float32)

    kv_len = tl.load(KvLens + seq)
    split_start = split * split_len
    split_end = tl.minimum(split_start + split_len, kv_len)

    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
    for start_n in range(split_start, split_end, BLOCK_N):
        k_pos = start_n + tl.arange(0, BLOCK_N)
        n_mask = k_pos < split_end
        page = tl.load(PageTable + seq * stride_pt + k_pos // PAGE_SIZE, mask=n_mask, other=0).to(tl.int64)
        slot = k_pos % PAGE_SIZE
        kv_mask = n_mask[:, None] & d_mask[None, :]
        k_ptrs = K + page[:, None] * stride_kp + slot[:, None] * stride_ks + kv_head * stride_kh \
            + offs_d[None, :] * stride_kd
        k = tl.load(k_ptrs, mask=kv_mask, other=0.0).to(q.dtype)  # [BLOCK_N, BLOCK_D]

        qk = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * sm_scale_log2  # [BLOCK_H, BLOCK_N]
        qk = tl.where(n_mask[None, :], qk, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, axis=1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(qk - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)

        v_ptrs = V + page[:, None] * stride_vp + slot[:, None] * stride_vs + kv_head * stride_vh \
            + offs_d[None, :] * stride_vd
        v = tl.load(v_ptrs, mask=kv_mask, other=0.0)
        if DOT_FP32:
            v = v.to(tl.float32)
        else:
            v = v.to(Q.dtype.element_ty)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new

    # an empty split (past kv_len) has l_i == 0: lse = -inf gives it zero weight in the merge
    has_kv = l_i > 0
    out = acc / tl.where(has_kv, l_i, 1.0)[:, None]
    lse = tl.where(has_kv, m_i + tl.log2(tl.where(has_kv, l_i, 1.0)), float("-inf"))
    po_ptrs = PartialOut + seq * stride_pob + heads[:, None] * stride_poh + split * stride_pos + offs_d[None, :]
    tl.store(po_ptrs, out, mask=h_mask[:, None])
    tl.store(PartialLse + seq * stride_plb + heads * stride_plh + split, lse, mask=h_mask)


@triton.jit
def _decode_reduce_kernel(
    PartialOut, PartialLse, Out,
    num_splits,
    stride_pob, stride_poh, stride_pos,
    stride_plb, stride_plh,
    stride_ot, stride_oh, stride_od,
    HEAD_DIM: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """Grid (batch, Hq): out = sum_s 2^(lse_s - lse) * out_s over the splits."""
    seq = tl.program_id(0)
    head = tl.program_id(1)
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    s_mask = offs_s < num_splits

    lse = tl.load(PartialLse + seq * stride_plb + head * stride_plh + offs_s, mask=s_mask,
                  other=float("-inf"))  # [BLOCK_S]
    weight = tl.exp2(lse - tl.max(lse, axis=0))  # split 0 always holds position 0, so max is finite
    weight = weight / tl.sum(weight, axis=0)
    po_ptrs = PartialOut + seq * stride_pob + head * stride_poh + offs_s[:, None] * stride_pos + offs_d[None, :]
    partial = tl.load(po_ptrs, mask=s_mask[:, None], other=0.0)  # [BLOCK_S, BLOCK_D]
    out = tl.sum(partial * weight[:, None], axis=0)  # [BLOCK_D]
    tl.store(Out + seq * stride_ot + head * stride_oh + offs_d * stride_od, out.to(Out.dtype.element_ty),
             mask=offs_d < HEAD_DIM)


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def _dot_precision(dtype: torch.dtype) -> str:
    return "ieee" if dtype == torch.float32 else "tf32"  # "tf32" only affects fp32 operands


def _block_d(head_dim: int) -> int:
    return max(16, triton.next_power_of_2(head_dim))


# The launchers and the sm_90 compile test build the kernels' constexprs through these, so the
# compile test checks exactly the configurations that get launched.
def extend_constexprs(dtype: torch.dtype, head_dim: int, group: int, page_size: int,
                      block_m: int = 64, block_n: int = 64, tree: bool = False) -> dict:
    return dict(HEAD_DIM=head_dim, GROUP=group, PAGE_SIZE=page_size, BLOCK_M=block_m, BLOCK_N=block_n,
                BLOCK_D=_block_d(head_dim), DOT_FP32=_interpreting(), DOT_PRECISION=_dot_precision(dtype),
                TREE=tree)


def decode_constexprs(dtype: torch.dtype, head_dim: int, group: int, page_size: int, block_n: int = 64) -> dict:
    # the group's q heads are the rows of one tl.dot, padded to its minimum of 16
    block_h = max(16, triton.next_power_of_2(group))
    return dict(HEAD_DIM=head_dim, GROUP=group, PAGE_SIZE=page_size, BLOCK_H=block_h, BLOCK_N=block_n,
                BLOCK_D=_block_d(head_dim), DOT_FP32=_interpreting(), DOT_PRECISION=_dot_precision(dtype))


def reduce_constexprs(head_dim: int, num_splits: int) -> dict:
    return dict(HEAD_DIM=head_dim, BLOCK_S=triton.next_power_of_2(num_splits), BLOCK_D=_block_d(head_dim))


def _check(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> int:
    """Validates shapes; returns the GQA group size Hq // Hkv."""
    if q.dim() != 3 or k_cache.dim() != 4 or v_cache.shape != k_cache.shape:
        raise ValueError(f"expected q [T, Hq, D] and k/v cache [pages, page_size, Hkv, D]; got "
                         f"q {tuple(q.shape)}, k {tuple(k_cache.shape)}, v {tuple(v_cache.shape)}")
    num_q_heads, head_dim = q.shape[1], q.shape[2]
    page_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    if k_cache.shape[3] != head_dim:
        raise ValueError(f"head_dim mismatch: q {head_dim}, cache {k_cache.shape[3]}")
    if num_q_heads % num_kv_heads:
        raise ValueError(f"num_q_heads {num_q_heads} is not a multiple of num_kv_heads {num_kv_heads}")
    if page_size & (page_size - 1):
        raise ValueError(f"page_size must be a power of two, got {page_size}")
    return num_q_heads // num_kv_heads


def paged_extend_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           qo_indptr: torch.Tensor, kv_lens: torch.Tensor, page_table: torch.Tensor,
                           sm_scale: float, out: torch.Tensor | None = None, max_q_len: int | None = None,
                           block_m: int = 64, block_n: int = 64, tree_mask: torch.Tensor | None = None,
                           tree_mask_indptr: torch.Tensor | None = None) -> torch.Tensor:
    """Ragged causal-with-offset (or tree-masked) attention. q [T, Hq, D] -> out [T, Hq, D] (q's dtype).

    qo_indptr [B+1] int32, kv_lens [B] int32, page_table [B, max_pages] int32; optional tree_mask
    [total] bool with tree_mask_indptr [B+1] int32 (see the module docstring). Pass `max_q_len`
    (known on the host) to avoid a device sync.
    """
    group = _check(q, k_cache, v_cache)
    tree = tree_mask is not None
    if tree:
        if tree_mask_indptr is None or tree_mask_indptr.shape[0] != kv_lens.shape[0] + 1:
            raise ValueError(f"tree_mask needs tree_mask_indptr of shape [{kv_lens.shape[0] + 1}], got "
                             f"{None if tree_mask_indptr is None else tuple(tree_mask_indptr.shape)}")
        if tree_mask.dtype != torch.bool:
            raise ValueError(f"tree_mask must be bool, got {tree_mask.dtype}")
        tree_mask = tree_mask.contiguous()
    out = torch.empty_like(q) if out is None else out
    batch = kv_lens.shape[0]
    if q.shape[0] == 0 or batch == 0:
        return out
    if max_q_len is None:
        max_q_len = int((qo_indptr[1:] - qo_indptr[:-1]).max().item())
    if page_table.stride(1) != 1:
        page_table = page_table.contiguous()
    grid = (triton.cdiv(max_q_len, block_m), batch, q.shape[1])
    _extend_kernel[grid](
        q, k_cache, v_cache, out, qo_indptr, kv_lens, page_table,
        tree_mask if tree else kv_lens, tree_mask_indptr if tree else qo_indptr,  # unread when not tree
        sm_scale * LOG2E,
        *q.stride(), *out.stride(), *k_cache.stride(), *v_cache.stride(), page_table.stride(0),
        **extend_constexprs(q.dtype, q.shape[2], group, k_cache.shape[1], block_m, block_n, tree),
    )
    return out


def decode_num_splits(batch: int, num_kv_heads: int, max_kv_len: int, block_n: int = 64,
                      target_programs: int = 256, max_splits: int = 32) -> int:
    """Enough KV splits to fill ~target_programs programs, never a split shorter than one block."""
    max_blocks = max(1, triton.cdiv(max_kv_len, block_n))
    want = max(1, target_programs // max(1, batch * num_kv_heads))
    return max(1, min(want, max_blocks, max_splits))


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           kv_lens: torch.Tensor, page_table: torch.Tensor, sm_scale: float,
                           out: torch.Tensor | None = None, max_kv_len: int | None = None,
                           num_splits: int | None = None, block_n: int = 64) -> torch.Tensor:
    """One query per sequence at position kv_len - 1. q [B, Hq, D] -> out [B, Hq, D].

    Split-K: each (sequence, kv head, split) program covers a chunk of KV for all q heads of the
    group; a second kernel merges the chunks by their log-sum-exp. Pass `max_kv_len` (known on the
    host) to avoid a device sync.
    """
    group = _check(q, k_cache, v_cache)
    block_d = _block_d(q.shape[2])
    out = torch.empty_like(q) if out is None else out
    batch, num_q_heads = q.shape[0], q.shape[1]
    if batch == 0:
        return out
    if max_kv_len is None:
        max_kv_len = int(kv_lens.max().item())
    if num_splits is None:
        num_splits = decode_num_splits(batch, k_cache.shape[2], max_kv_len, block_n)
    split_len = triton.cdiv(triton.cdiv(max(max_kv_len, 1), num_splits), block_n) * block_n
    if page_table.stride(1) != 1:
        page_table = page_table.contiguous()
    # [B, Hq, num_splits, BLOCK_D] / [B, Hq, num_splits], fp32
    partial_out = torch.empty(batch, num_q_heads, num_splits, block_d, dtype=torch.float32, device=q.device)
    partial_lse = torch.empty(batch, num_q_heads, num_splits, dtype=torch.float32, device=q.device)
    _decode_split_kernel[(batch, k_cache.shape[2], num_splits)](
        q, k_cache, v_cache, partial_out, partial_lse, kv_lens, page_table,
        sm_scale * LOG2E, split_len,
        *q.stride(), *k_cache.stride(), *v_cache.stride(), page_table.stride(0),
        *partial_out.stride()[:3], *partial_lse.stride()[:2],
        **decode_constexprs(q.dtype, q.shape[2], group, k_cache.shape[1], block_n),
    )
    _decode_reduce_kernel[(batch, num_q_heads)](
        partial_out, partial_lse, out, num_splits,
        *partial_out.stride()[:3], *partial_lse.stride()[:2], *out.stride(),
        **reduce_constexprs(q.shape[2], num_splits),
    )
    return out


__all__ = ["paged_extend_attention", "paged_decode_attention", "decode_num_splits", "extend_constexprs",
           "decode_constexprs", "reduce_constexprs"]
