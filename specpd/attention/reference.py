"""Pure-torch paged attention: the reference every kernel is tested against (and the CPU path).

Shapes: q [num_tokens, num_q_heads, head_dim]; k_cache / v_cache [num_pages, page_size, kv_heads,
head_dim] (may be strided views of the page-major pool); qo_indptr [batch+1]; kv_lens [batch];
page_table [batch, max_pages]. Query j of sequence b is at position kv_len - q_len + j and sees KV
positions <= its own (causal with a prefix offset). GQA: q head h reads kv head h // (Hq // Hkv).
"""
from __future__ import annotations

import torch


def gather_kv(cache: torch.Tensor, pages: torch.Tensor, kv_len: int) -> torch.Tensor:
    """[num_pages, page_size, H, D] + page ids -> [kv_len, H, D] in position order."""
    page_size = cache.shape[1]
    n = (kv_len + page_size - 1) // page_size
    return cache[pages[:n].long()].reshape(-1, *cache.shape[2:])[:kv_len]


def paged_attention_ref(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                        qo_indptr: torch.Tensor, kv_lens: torch.Tensor, page_table: torch.Tensor,
                        sm_scale: float, tree_mask: torch.Tensor | None = None,
                        tree_mask_indptr: torch.Tensor | None = None) -> torch.Tensor:
    """Straightforward fp32 math, one sequence at a time. Returns [num_tokens, Hq, D] in q's dtype."""
    out = torch.empty_like(q)
    num_q_heads = q.shape[1]
    group = num_q_heads // k_cache.shape[2]
    indptr = qo_indptr.tolist()
    tree_indptr = tree_mask_indptr.tolist() if tree_mask is not None else None
    for b, kv_len in enumerate(kv_lens.tolist()):
        start, end = indptr[b], indptr[b + 1]
        q_len = end - start
        if q_len == 0:
            continue
        k = gather_kv(k_cache, page_table[b], kv_len).float().repeat_interleave(group, dim=1)
        v = gather_kv(v_cache, page_table[b], kv_len).float().repeat_interleave(group, dim=1)
        qb = q[start:end].float()
        scores = torch.einsum("qhd,khd->hqk", qb, k) * sm_scale  # [Hq, q_len, kv_len]
        visible = torch.ones(q_len, kv_len, dtype=torch.bool)  # [q_len, kv_len]; the prefix stays True
        if tree_indptr is not None and tree_indptr[b + 1] > tree_indptr[b]:
            tree = tree_mask[tree_indptr[b]:tree_indptr[b + 1]].view(q_len, -1)  # [q_len, width]
        else:
            tree = torch.ones(q_len, q_len, dtype=torch.bool).tril()
        visible[:, kv_len - tree.shape[1]:] = tree.cpu()
        scores = scores.masked_fill(~visible.to(scores.device), float("-inf"))
        probs = scores.softmax(dim=-1)
        out[start:end] = torch.einsum("hqk,khd->qhd", probs, v).to(q.dtype)
    return out


def rope_ref(x: torch.Tensor, pos: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """fp32 Neox RoPE of x [T, H, D] at positions pos [T] (sin sign-folded, as Rotary keeps it)."""
    x = x.float()
    half = x.shape[-1] // 2
    swapped = torch.cat([x[..., half:], x[..., :half]], dim=-1)
    return x * cos[pos].unsqueeze(1) + swapped * sin[pos].unsqueeze(1)


def fused_attention_ref(q, q_pos, k, v, w_pos, w_slots, cos, sin, layer_buffer, layer, qo_indptr, kv_lens, page_table,
                        tree_mask, tree_indptr, num_q_heads, sm_scale):
    """The torch reference of specpd.kernels.cpu_attention.paged_attention (same arguments, same result up to fp32 rounding)."""
    buf = layer_buffer
    page_size = buf.shape[3]
    if k is not None:
        kr = rope_ref(k, w_pos, cos, sin) if cos is not None else k.float()
        pages, offsets = w_slots // page_size, w_slots % page_size
        buf[pages, layer, 0, offsets] = kr.to(buf.dtype)
        buf[pages, layer, 1, offsets] = v.to(buf.dtype)
    if q is None:
        return None
    qr = rope_ref(q, q_pos, cos, sin) if cos is not None else q.float()
    out = paged_attention_ref(qr, buf[:, layer, 0], buf[:, layer, 1], qo_indptr, kv_lens, page_table, sm_scale,
                              tree_mask, tree_indptr)
    return out.to(buf.dtype).reshape(q.shape[0], -1)
