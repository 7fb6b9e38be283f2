"""KV compaction for tree-verify commit: move the accepted path's K/V to consecutive slots.

A verified tree's nodes sit in consecutive scratch slots after the committed prefix (node i at
position committed_len + i). The accepted path is a chain of nodes i_0, i_1, ... (numbered parents
first, so i_k >= k); commit moves node i_k's K/V, every layer, K and V, to position
committed_len + k so that the sequence is position-ordered again (docs/architecture.md §4). Call once per pool
(target, and the draft's if it has its own).

Moves are given as slots: (src_pages[m], src_offsets[m]) -> (dst_pages[m], dst_offsets[m]), all
[num_moves] int64, over a page-major pool buffer [num_pages, num_layers, 2, page_size, Hkv, D] (any strides
but a contiguous head_dim: specpd/kv/pool.py keeps heads outside layers in memory).
Semantics, for both implementations: gather every source slot first, then scatter to the
destinations. Source and destination sets may overlap in any way (the usual k <= i_k shift, or even a
permutation); destination slots must be distinct. Values are copied bit for bit, any dtype.

The Triton kernel runs twice, pool -> staging [num_moves, num_layers, 2, Hkv * D] -> pool, so no
program can overwrite a slot another program has yet to read. The staging copy is small (a path of
tokens), and it makes the result independent of both program order and the caller's path order.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


def compact_kv_ref(pool_buffer: torch.Tensor, src_pages: torch.Tensor, src_offsets: torch.Tensor,
                   dst_pages: torch.Tensor, dst_offsets: torch.Tensor) -> None:
    """In place. Advanced indexing copies all sources before the scatter writes anything."""
    _check(pool_buffer, src_pages, src_offsets, dst_pages, dst_offsets)
    slots = dst_pages * pool_buffer.shape[3] + dst_offsets  # [num_moves] flat slot id
    if slots.unique().numel() != slots.numel():
        raise ValueError(f"destination slots must be distinct, got pages {dst_pages.tolist()} "
                         f"offsets {dst_offsets.tolist()}")
    moved = pool_buffer[src_pages, :, :, src_offsets]  # [num_moves, num_layers, 2, Hkv, D]
    pool_buffer[dst_pages, :, :, dst_offsets] = moved


@triton.jit
def _move_slots_kernel(
    Pool, Staging, Pages, Offsets,
    stride_pp, stride_pl, stride_pkv, stride_ps, stride_ph,  # pool: page, layer, K/V, slot, head; D contiguous
    stride_sm, stride_sl, stride_skv,  # staging: move, layer, K/V; a slot's Hkv * D is contiguous
    HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK: tl.constexpr, GATHER: tl.constexpr,
):
    """Grid (num_moves, num_layers): K and V of every head of one layer of one slot.

    GATHER: pool slot (Pages[m], Offsets[m]) -> staging row m; otherwise staging row m -> that slot.
    """
    move = tl.program_id(0)
    layer = tl.program_id(1)
    page = tl.load(Pages + move).to(tl.int64)  # int64: a large pool overflows int32 element offsets
    offset = tl.load(Offsets + move).to(tl.int64)
    pool_slot = Pool + page * stride_pp + layer * stride_pl + offset * stride_ps
    staged = Staging + move.to(tl.int64) * stride_sm + layer * stride_sl
    for kv in tl.static_range(2):
        for h in range(HEADS):
            for start in range(0, HEAD_DIM, BLOCK):
                offs = start + tl.arange(0, BLOCK)
                mask = offs < HEAD_DIM
                pool_at = pool_slot + kv * stride_pkv + h * stride_ph + offs
                staged_at = staged + kv * stride_skv + h * HEAD_DIM + offs
                if GATHER:
                    tl.store(staged_at, tl.load(pool_at, mask=mask), mask=mask)
                else:
                    tl.store(pool_at, tl.load(staged_at, mask=mask), mask=mask)


def compact_constexprs(kv_heads: int, head_dim: int, gather: bool) -> dict:
    """Shared by the launcher and the sm_90 compile test."""
    return dict(HEADS=kv_heads, HEAD_DIM=head_dim, BLOCK=min(triton.next_power_of_2(head_dim), 2048), GATHER=gather)


def _check(pool_buffer: torch.Tensor, src_pages: torch.Tensor, src_offsets: torch.Tensor,
           dst_pages: torch.Tensor, dst_offsets: torch.Tensor) -> int:
    """Validates shapes; returns num_moves."""
    if pool_buffer.dim() != 6 or pool_buffer.shape[2] != 2:
        raise ValueError(f"expected a pool buffer [num_pages, num_layers, 2, page_size, Hkv, D], "
                         f"got {tuple(pool_buffer.shape)}")
    shapes = [tuple(t.shape) for t in (src_pages, src_offsets, dst_pages, dst_offsets)]
    if any(len(s) != 1 or s != shapes[0] for s in shapes):
        raise ValueError(f"src_pages, src_offsets, dst_pages, dst_offsets must be 1-D of one length, got {shapes}")
    return shapes[0][0]


def compact_kv(pool_buffer: torch.Tensor, src_pages: torch.Tensor, src_offsets: torch.Tensor,
               dst_pages: torch.Tensor, dst_offsets: torch.Tensor) -> None:
    """In place, same semantics as `compact_kv_ref`; no device sync (distinct destinations unchecked)."""
    num_moves = _check(pool_buffer, src_pages, src_offsets, dst_pages, dst_offsets)
    _, num_layers, _, _, kv_heads, head_dim = pool_buffer.shape
    if pool_buffer.stride(5) != 1:
        raise ValueError(f"a head's D values must be contiguous in the pool buffer, strides {pool_buffer.stride()}")
    if num_moves == 0:
        return
    # [num_moves, num_layers, 2, Hkv * D]
    staging = torch.empty(num_moves, num_layers, 2, kv_heads * head_dim, dtype=pool_buffer.dtype,
                          device=pool_buffer.device)
    pool_strides = pool_buffer.stride()[:5]
    for pages, offsets, gather in ((src_pages, src_offsets, True), (dst_pages, dst_offsets, False)):
        _move_slots_kernel[(num_moves, num_layers)](
            pool_buffer, staging, pages.contiguous(), offsets.contiguous(),
            *pool_strides, *staging.stride()[:3],
            **compact_constexprs(kv_heads, head_dim, gather),
        )


def path_slot_moves(pages: list[int], committed_len: int, accepted_nodes: list[int],
                    page_size: int) -> tuple[list[int], list[int], list[int], list[int]]:
    """Host-side moves for one sequence: tree node accepted_nodes[k] (at position committed_len +
    node) -> position committed_len + k. Nodes already in place are left out.

    Returns (src_pages, src_offsets, dst_pages, dst_offsets), plain lists of equal length.
    """
    src_pages: list[int] = []
    src_offsets: list[int] = []
    dst_pages: list[int] = []
    dst_offsets: list[int] = []
    for k, node in enumerate(accepted_nodes):
        if node == k:
            continue
        src, dst = committed_len + node, committed_len + k
        src_pages.append(pages[src // page_size])
        src_offsets.append(src % page_size)
        dst_pages.append(pages[dst // page_size])
        dst_offsets.append(dst % page_size)
    return src_pages, src_offsets, dst_pages, dst_offsets


def compact_pool(pool, moves: tuple[list[int], list[int], list[int], list[int]]) -> None:
    """Apply path_slot_moves' moves to a KVPool's buffer: the Triton kernel on a GPU, the torch reference on CPU."""
    buffer = pool.buffer
    compact = compact_kv if buffer.is_cuda else compact_kv_ref
    compact(buffer, *(torch.tensor(m, device=buffer.device) for m in moves))


__all__ = ["compact_kv", "compact_kv_ref", "compact_constexprs", "compact_pool", "path_slot_moves"]
