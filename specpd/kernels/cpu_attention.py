"""Paged attention on CPU in one C call per layer (csrc/cpu_attention.c): write the step's new K/V into the
page-major pool with RoPE applied to K, then attend every query row (RoPE applied to Q) over its pages with
a causal or a tree mask. It reads K/V where they lie in the pool: no page gather, no padded batches, no
mask tensors; the query heads of one KV head share every K/V load (GQA).

Contract (AttentionMetadata's): query j of sequence b sits at KV position kv_len - q_len + j; it sees every
position before the sequence's mask block, then within the block causally (block = the last q_len
positions) or by the sequence's tree mask ([q_len, width] over the last width positions). The rope tables
are fp32 ([max_pos, D]: cos and the sign-folded sin of specpd.model.llama.Rotary); Q and K are rotated in
fp32, K is rounded to the pool's dtype as it is stored, scores and the softmax run in fp32, and the output is
rounded once to the query's dtype. On a CPU with AMX a bf16 pool is attended on tiles
(build.attention_amx_wanted; SPECPD_ATTENTION_AMX=0 turns it off): the rotated, scaled query and the softmax's
probabilities are rounded to bf16 for the tile products (sums in fp32), as GPU flash attention does, for decode
and verify rows alike; on one with AVX512-BF16 but no AMX the same rounding runs on vdpbf16ps pair dot products
(build.attention_dp_wanted; SPECPD_ATTENTION_DP=0 turns it off). A row's result does not depend on the rows that share its call (a verify
row equals the decode step over the same prefix bit for bit).

`specpd.attention.reference.fused_attention_ref` is the torch reference (paged_attention_ref over the same
rotated inputs); the tests compare them on ragged batches, scattered pages, page boundaries, trees, GQA and
every dtype.
"""
from __future__ import annotations

import ctypes
import functools

import torch

from specpd.kernels.build import DTYPE_CODES, load, unavailable
from specpd.kernels.build import INT64 as _I
from specpd.kernels.build import VOID_P as _P


@functools.cache
def _lib():
    """The kernel library (None without a C compiler); `lib.attention_amx`: whether bf16 attends on AMX tiles."""
    return load("cpu_attention.c")


@functools.cache
def _kernel():
    lib = _lib()
    if lib is None:
        return None
    fn = lib.specpd_attention
    fn.argtypes = [ctypes.c_int, _P, _I, _P, _P, _P, _I, _I, _P, _P, _P, _P,
                   _P, _I, _I, _I, _I, _I, _I, _P, _P, _P, _I, _I, _P, _P, _I, _I, _I, ctypes.c_float, _P]
    fn.restype = ctypes.c_int
    return fn


def available() -> bool:
    return _kernel() is not None


def why_unavailable() -> str:
    """Why the kernel is not here (build.load's logged reason); CpuAttentionBackend names it as it falls back."""
    return f"csrc/cpu_attention.c: {unavailable('cpu_attention.c') or 'not loaded'}"


def _require():
    """The kernel's entry point; a caller that did not check `available` first gets why it is missing."""
    fn = _kernel()
    if fn is None:
        raise RuntimeError(f"the C attention kernel is not available: {why_unavailable()}")
    return fn


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def _rows(t: torch.Tensor, name: str) -> int:
    """Row stride of a [T, H, D] view whose heads and dims are packed (a slice of a fused qkv projection)."""
    if t.dim() != 3 or t.stride(2) != 1 or t.stride(1) != t.shape[2]:
        raise ValueError(f"{name}: need a [T, H, D] view with contiguous heads, got shape {tuple(t.shape)} "
                         f"strides {t.stride()}")
    return t.stride(0)


def paged_attention(q: torch.Tensor | None, q_pos: torch.Tensor | None, k: torch.Tensor | None,
                    v: torch.Tensor | None, w_pos: torch.Tensor | None, w_slots: torch.Tensor | None,
                    cos: torch.Tensor | None, sin: torch.Tensor | None, layer_buffer: torch.Tensor, layer: int,
                    qo_indptr: torch.Tensor, kv_lens: torch.Tensor, page_table: torch.Tensor,
                    tree_mask: torch.Tensor | None, tree_indptr: torch.Tensor | None, num_q_heads: int,
                    sm_scale: float) -> torch.Tensor | None:
    """q [Tq, Hq, D] (q_pos [Tq] int64: its positions, for RoPE); k, v [Tw, Hkv, D] new tokens written at
    w_slots [Tw] int64 (page * page_size + offset; w_pos: positions for RoPE) before anything is read; cos, sin
    [max_pos, D] fp32 or None (no RoPE); layer_buffer: the pool's page-major buffer [num_pages, layers, 2,
    page_size, Hkv, D] (a strided view is fine); qo_indptr [B + 1], kv_lens [B], page_table [B, max_pages]
    int32; tree_mask bool flat with tree_indptr [B + 1] int32 (or None). Returns out [Tq, Hq * D] in q's dtype
    (None when q is None: a write only)."""
    fn = _require()
    buf = layer_buffer
    dtype = buf.dtype
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t is not None and t.dtype != dtype:
            raise ValueError(f"{name} is {t.dtype}, the pool {dtype}")
    d = buf.shape[-1]
    hkv = buf.shape[-2]
    out = None if q is None else torch.empty(q.shape[0], num_q_heads * d, dtype=dtype, device=buf.device)
    tw = 0 if k is None else k.shape[0]
    kv_stride = 0 if k is None else _rows(k, "k")
    if v is not None and _rows(v, "v") != kv_stride:
        raise ValueError("k and v must share a row stride (slices of one qkv tensor)")
    k_off = layer * buf.stride(1)
    for t, want in ((qo_indptr, torch.int32), (kv_lens, torch.int32), (page_table, torch.int32),
                    (tree_indptr, torch.int32), (q_pos, torch.int64), (w_pos, torch.int64), (w_slots, torch.int64)):
        if t is not None and (t.dtype != want or not t.is_contiguous()):
            raise ValueError(f"metadata tensors must be contiguous {want}, got {t.dtype}")
    rc = fn(DTYPE_CODES[dtype], _ptr(q), 0 if q is None else _rows(q, "q"), _ptr(q_pos),
            _ptr(k), _ptr(v), kv_stride, tw, _ptr(w_pos), _ptr(w_slots),
            _ptr(cos), _ptr(sin),
            buf.data_ptr(), buf.stride(0), k_off, k_off + buf.stride(2), buf.stride(3), buf.stride(4), buf.shape[3],
            qo_indptr.data_ptr(), kv_lens.data_ptr(), page_table.data_ptr(), page_table.shape[1],
            kv_lens.shape[0], _ptr(tree_mask), _ptr(tree_indptr),
            num_q_heads, hkv, d, float(sm_scale), _ptr(out))
    if rc != 0:
        raise ValueError(f"cpu attention: unsupported shape (Hq {num_q_heads}, Hkv {hkv}, head_dim {d})")
    return out


class Prepared:
    """paged_attention's arguments that stay the same for every layer of a step (checked once, at plan time):
    the pool, the rope tables, the write slots and the query batch's metadata. `run` takes a layer's fused
    qkv and makes one kernel call with no per-call checks: the hot path of CpuAttentionBackend."""

    def __init__(self, layer_buffer: torch.Tensor, num_q_heads: int, sm_scale: float, w_slots: torch.Tensor,
                 qo_indptr: torch.Tensor, kv_lens: torch.Tensor, page_table: torch.Tensor,
                 tree_mask: torch.Tensor | None, tree_indptr: torch.Tensor | None):
        buf = layer_buffer
        for t, want in ((qo_indptr, torch.int32), (kv_lens, torch.int32), (page_table, torch.int32),
                        (tree_indptr, torch.int32), (w_slots, torch.int64)):
            if t is not None and (t.dtype != want or not t.is_contiguous()):
                raise ValueError(f"metadata tensors must be contiguous {want}, got {t.dtype}")
        self.fn = _require()
        self.buf, self.dtype, self.d, self.hkv, self.hq = buf, buf.dtype, buf.shape[-1], buf.shape[-2], num_q_heads
        self.keep = (w_slots, qo_indptr, kv_lens, page_table, tree_mask, tree_indptr)  # alive while in use
        self.layer_stride, self.kv_half = buf.stride(1), buf.stride(2)
        self.pool_args = (buf.data_ptr(), buf.stride(0))
        self.tail = (buf.stride(3), buf.stride(4), buf.shape[3], qo_indptr.data_ptr(), kv_lens.data_ptr(),
                     page_table.data_ptr(), page_table.shape[1], kv_lens.shape[0], _ptr(tree_mask), _ptr(tree_indptr),
                     num_q_heads, self.hkv, self.d, float(sm_scale))
        self.w_slots = w_slots.data_ptr()

    def run(self, qkv: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, layer: int,
            q: torch.Tensor | None = None, q_pos: torch.Tensor | None = None) -> torch.Tensor:
        """qkv [T, Hq + 2 Hkv, D] contiguous in the pool's dtype, positions [T] int64 (written at the prepared
        slots); q / q_pos: the rows that attend when not all of qkv's (a gathered [R, Hq, D] copy). -> [R, Hq*D]."""
        if q is None:
            q_ptr, q_stride, q_pos, rows = qkv.data_ptr(), qkv.stride(0), positions, qkv.shape[0]
        else:
            q_ptr, q_stride, rows = q.data_ptr(), q.stride(0), q.shape[0]
        out = torch.empty(rows, self.hq * self.d, dtype=self.dtype)
        self._call(qkv, positions, cos, sin, layer, q_ptr, q_stride, q_pos.data_ptr(), out.data_ptr())
        return out

    def write(self, qkv: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
              layer: int) -> None:
        """The KV write of `run` alone (RoPE on K at `positions`, into the prepared slots); no row attends."""
        self._call(qkv, positions, cos, sin, layer, None, 0, None, None)

    def _call(self, qkv, positions, cos, sin, layer: int, q_ptr, q_stride: int, q_pos_ptr, out_ptr) -> None:
        d, hq, hkv = self.d, self.hq, self.hkv
        base, esize, k_off = qkv.data_ptr(), qkv.element_size(), layer * self.layer_stride
        rc = self.fn(DTYPE_CODES[self.dtype], q_ptr, q_stride, q_pos_ptr, base + hq * d * esize,
                     base + (hq + hkv) * d * esize, qkv.stride(0), qkv.shape[0], positions.data_ptr(), self.w_slots,
                     cos.data_ptr(), sin.data_ptr(), self.pool_args[0], self.pool_args[1], k_off, k_off + self.kv_half,
                     *self.tail, out_ptr)
        if rc != 0:
            raise ValueError(f"cpu attention: unsupported shape (Hq {hq}, Hkv {hkv}, head_dim {d})")

