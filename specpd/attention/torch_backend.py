"""Torch attention backend: the CPU serving path. Same math as reference.py, batched with SDPA.

Short query blocks (decode rows, tree verify / draft steps, small chunks) are padded into batches
and attended with one SDPA call per batch over their gathered pages and a [batch, q_max, kv_max]
mask; sequences are grouped by KV length (`group_by_pages`) so one long context does not make every
short row gather and attend over its length. Each long prefill/extend sequence is attended on its
own (plain causal when it has no prefix). Masks
follow AttentionMetadata: the prefix is visible, then causal, or the sequence's tree block.

CPU speed notes (SmolLM2-135M, 1 thread): pages are gathered with `index_select` (4x faster than
`k_cache[pages]` advanced indexing on the strided pool view); SDPA always gets 4-D tensors (3-D
ones fall back to the slow math kernel); the padded mask is built once per step as an additive
float mask in the pool's dtype (a bool mask is converted by SDPA in every layer).

Under a CUDA graph (`plan_static`) a padded batch (specpd/attention/static.py) is one padded SDPA call over
every request and the graph's longest KV, positions past a request's KV masked; its index and mask tensors are
copied into buffers kept per shape, so the replayed forward reads the same storage every step.
"""
from __future__ import annotations

from dataclasses import dataclass
from itertools import accumulate

import torch
import torch.nn.functional as F

from specpd.attention.base import AttentionBackend
from specpd.attention.metadata import AttentionMetadata

SHORT_Q = 32  # query blocks up to this length share padded SDPA calls
GROUP_COST_PAGES = 64  # what one more padded SDPA call costs, in rows x pages gathered (group_by_pages)


def group_by_pages(pages: list[int], call_cost: int = GROUP_COST_PAGES) -> list[list[int]]:
    """Split sequences (their KV lengths in pages) into padded batches minimising
    sum(len(batch) * max pages in batch) + call_cost per batch; returns index lists. Exact DP over the
    sequences sorted by length, whose optimum is contiguous runs of that order and never splits
    sequences of equal length (moving such a cut to the end of their run costs no more): so the DP runs
    over the distinct lengths, O(distinct^2) — a 1024-request batch of one length is one step, not 10^6."""
    order = sorted(range(len(pages)), key=lambda i: pages[i])
    lengths: list[int] = []  # distinct lengths, ascending
    ends: list[int] = []  # ends[r]: sequences of the first r + 1 lengths
    for k, i in enumerate(order):
        if lengths and pages[i] == lengths[-1]:
            ends[-1] = k + 1
        else:
            lengths.append(pages[i])
            ends.append(k + 1)
    starts = [0] + ends
    best = [0] + [None] * len(lengths)  # best[r]: cost of the sequences of the first r lengths
    cut = [0] * (len(lengths) + 1)
    for r in range(1, len(lengths) + 1):
        top, end = lengths[r - 1], ends[r - 1]
        for q in range(r):
            cost = best[q] + (end - starts[q]) * top + call_cost
            if best[r] is None or cost < best[r]:
                best[r], cut[r] = cost, q
    groups, r = [], len(lengths)
    while r > 0:
        groups.append(order[starts[cut[r]]:ends[r - 1]])
        r = cut[r]
    return groups[::-1]


@dataclass
class _Padded:
    rows: torch.Tensor  # [B * q_max] long, token rows of each sequence's queries, sequence by sequence (padding: 0)
    q_max: int
    valid: torch.Tensor | None  # long, the positions in `rows` that are real queries; None: all of them
    dst: torch.Tensor  # long, the token rows those queries' outputs go to (rows[valid])
    pages: torch.Tensor  # [B * n_pages] long, page ids of sequence 0, then 1, ...
    mask: torch.Tensor  # [B, 1, q_max, n_pages * page_size] additive float (0 = attend, -inf = not)
    # every token of the batch is a valid query and they come in order: q is viewed, not gathered
    dense: bool
    folded: torch.Tensor | None = None  # mask.repeat(1, 1, group, 1) for the fp32 GQA fold (q_max > 1)


@dataclass
class _TorchPlan:
    padded: list[_Padded]
    # (token_start, token_end, page ids [n_pages] long, kv_len, mask [q_len, kv_len] or None = causal)
    long: list[tuple[int, int, torch.Tensor, int, torch.Tensor | None]]


def _tree_block(meta: AttentionMetadata, tree_indptr: list[int] | None, b: int) -> torch.Tensor | None:
    if tree_indptr is None or tree_indptr[b + 1] == tree_indptr[b]:
        return None
    return meta.tree_mask[tree_indptr[b]:tree_indptr[b + 1]].view(meta.q_lens_host[b], -1)  # [q_len, width]


class TorchAttentionBackend(AttentionBackend):
    name = "torch"
    static_plan = True

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._static: dict[tuple, _Padded] = {}  # plan_static's buffers, per shape

    def plan_static(self, meta: AttentionMetadata, max_kv_len: int) -> AttentionMetadata:
        bs = meta.batch_size
        indptr = list(accumulate(meta.q_lens_host, initial=0))
        tree_indptr = None
        if meta.tree_mask is not None:  # a padded batch's blocks are all one size
            cells = meta.tree_mask.numel() // bs
            tree_indptr = list(range(0, cells * bs + 1, cells))
        pad = self._plan_padded(meta, list(range(bs)), indptr, tree_indptr,
                                n_pages=-(-max_kv_len // meta.page_size))
        key = (pad.rows.shape, pad.mask.shape, pad.pages.shape, pad.mask.dtype)
        kept = self._static.get(key)
        if kept is None:
            kept = self._static[key] = pad
        else:
            for name in ("rows", "pages", "mask", "folded"):
                if getattr(pad, name) is not None:
                    getattr(kept, name).copy_(getattr(pad, name))
        meta.plan = _TorchPlan([kept], [])
        return meta

    def plan(self, meta: AttentionMetadata) -> AttentionMetadata:
        indptr = meta.qo_indptr.tolist()
        tree_indptr = meta.tree_mask_indptr.tolist() if meta.tree_mask is not None else None
        short = [b for b, q in enumerate(meta.q_lens_host) if 0 < q <= SHORT_Q]
        long = []
        for b, q_len in enumerate(meta.q_lens_host):
            if q_len <= SHORT_Q:
                continue
            kv_len = meta.kv_lens_host[b]
            tree = _tree_block(meta, tree_indptr, b)
            mask = None
            if tree is not None:
                prefix = torch.ones(q_len, kv_len - tree.shape[1], dtype=torch.bool, device=tree.device)
                mask = torch.cat([prefix, tree], dim=1)  # [q_len, kv_len]
            elif kv_len != q_len:
                q_pos = torch.arange(kv_len - q_len, kv_len, device=meta.page_table.device).unsqueeze(1)
                mask = torch.arange(kv_len, device=q_pos.device).unsqueeze(0) <= q_pos
            n_pages = (kv_len + meta.page_size - 1) // meta.page_size
            long.append((indptr[b], indptr[b + 1], meta.page_table[b, :n_pages].long(), kv_len, mask))
        # one-row queries (decode, a depth-0 round) batch apart from multi-row blocks (verify trees, draft
        # frontiers): padded into one batch, every decode row would attend as q_max rows
        padded = []
        for part in ([b for b in short if meta.q_lens_host[b] == 1], [b for b in short if meta.q_lens_host[b] > 1]):
            if part:
                for g in group_by_pages([-(-meta.kv_lens_host[b] // meta.page_size) for b in part]):
                    padded.append(self._plan_padded(meta, [part[i] for i in sorted(g)], indptr, tree_indptr))
        meta.plan = _TorchPlan(padded, long)
        return meta

    def _plan_padded(self, meta, seqs: list[int], indptr: list[int], tree_indptr, n_pages: int | None = None
                     ) -> _Padded:
        """n_pages: each sequence's pages attended (default: the longest KV's; pages past a KV are masked)."""
        q_lens = [meta.q_lens_host[b] for b in seqs]
        kv_lens = [meta.kv_lens_host[b] for b in seqs]
        q_max, kv_max = max(q_lens), max(kv_lens)
        n_pages = n_pages or (kv_max + meta.page_size - 1) // meta.page_size
        # last visible slot of each query row: causal with the prefix offset; a padding row sees slot 0
        # only (no NaN; its output is dropped). Built from host lists: a few small tensor ops per step.
        last = torch.tensor([[kv - q + j if j < q else 0 for j in range(q_max)] for q, kv in zip(q_lens, kv_lens)])
        mask = torch.arange(n_pages * meta.page_size) <= last.unsqueeze(-1)  # [B, q_max, kv_slots]
        for i, b in enumerate(seqs):
            tree = _tree_block(meta, tree_indptr, b)
            if tree is not None:
                q_len, kv_len, width = q_lens[i], kv_lens[i], tree.shape[1]
                mask[i, :q_len, :kv_len - width] = True
                mask[i, :q_len, kv_len - width:kv_len] = tree.to(mask.device)
        valid = torch.tensor([[j < q for j in range(q_max)] for q in q_lens])  # [B, q_max]
        rows = torch.tensor([[indptr[b] + j if j < q else 0 for j in range(q_max)] for b, q in zip(seqs, q_lens)])
        dense = len(seqs) == meta.batch_size and len(set(q_lens)) == 1
        dev = meta.page_table.device  # built on the host, used where the pool is
        additive = mask.to(dev, self.kv_pool.dtype).log_().unsqueeze(1)  # log(1) = 0 (attend), log(0) = -inf
        idx = torch.tensor(seqs, device=dev)
        rows, flat = rows.flatten().to(dev), valid.flatten()
        keep = None if bool(flat.all()) else flat.nonzero().squeeze(1).to(dev)
        return _Padded(rows, q_max, keep, rows if keep is None else rows[keep],
                       meta.page_table[idx, :n_pages].long().flatten(), additive, dense, self._fold_mask(additive))

    def _fold_mask(self, additive: torch.Tensor) -> torch.Tensor | None:
        """The mask for _padded_sdpa's fp32 GQA fold, [B, 1, group * q_max, S], built once per step."""
        group = self.num_q_heads // self.kv_pool.kv_heads
        if additive.dtype != torch.float32 or group == 1 or additive.shape[2] == 1:
            return None
        return additive.repeat(1, 1, group, 1)

    def forward(self, q, k, v, layer_id, meta):
        pool = self.kv_pool
        pool.write(layer_id, k, v, meta.write_pages, meta.write_offsets)
        k_cache, v_cache = pool.k_cache(layer_id), pool.v_cache(layer_id)
        plan: _TorchPlan = meta.plan
        out = torch.empty_like(q)
        for pad in plan.padded:
            q_max = pad.q_max
            nb = pad.rows.shape[0] // q_max
            kb = _gather(k_cache, pad.pages, nb, q.dtype)  # [B, Hkv, S, D]
            vb = _gather(v_cache, pad.pages, nb, q.dtype)
            qb = (q if pad.dense else q.index_select(0, pad.rows)).view(nb, q_max, *q.shape[1:]).transpose(1, 2)
            mask = pad.mask if pad.mask.dtype == q.dtype else pad.mask.to(q.dtype)
            ob = self._padded_sdpa(qb, kb, vb, mask, pad.folded).transpose(1, 2)  # [B, q_max, Hq, D]
            if pad.dense:
                return ob.reshape(q.shape)
            ob = ob.reshape(-1, *q.shape[1:])  # [B * q_max, Hq, D]
            out.index_copy_(0, pad.dst, ob if pad.valid is None else ob.index_select(0, pad.valid))
        for start, end, pages, kv_len, mask in plan.long:
            kb = _gather(k_cache, pages, 1, q.dtype)[:, :, :kv_len]  # [1, Hkv, kv_len, D]
            vb = _gather(v_cache, pages, 1, q.dtype)[:, :, :kv_len]
            qb = q[start:end].transpose(0, 1).unsqueeze(0)  # [1, Hq, q_len, D]
            ob = F.scaled_dot_product_attention(qb, kb, vb, attn_mask=mask, is_causal=mask is None,
                                                scale=self.sm_scale, enable_gqa=True)
            out[start:end] = ob[0].transpose(0, 1)
        return out

    def _padded_sdpa(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor,
                     folded: torch.Tensor | None = None) -> torch.Tensor:
        """q [B, Hq, q_max, D], k/v [B, Hkv, S, D], mask [B, 1, q_max, S] -> [B, Hq, q_max, D].
        folded: the plan's mask.repeat(1, 1, group, 1), when it made one."""
        b, hq, q_max, d = q.shape
        group = hq // k.shape[1]
        if q.dtype != torch.float32 or group == 1:
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=self.sm_scale, enable_gqa=True)
        # fp32: fold each kv head's query heads into query rows, [B, Hkv, group * q_max, D] (row g * q_max + j),
        # faster than enable_gqa's repeated K/V on CPU (one GEMM per kv head); bf16 gains nothing from it
        qf = q.reshape(b, -1, group * q_max, d)
        if q_max > 1:  # one query row broadcasts as is
            mask = folded if folded is not None else mask.repeat(1, 1, group, 1)
        out = F.scaled_dot_product_attention(qf, k, v, attn_mask=mask, scale=self.sm_scale)
        return out.reshape(b, hq, q_max, d)  # CUDA SDPA may return another layout: a view can fail there


def _gather(cache: torch.Tensor, pages: torch.Tensor, batch: int, dtype: torch.dtype) -> torch.Tensor:
    """cache [num_pages, page_size, Hkv, D] (strided pool view), pages [batch * n_pages] ->
    [batch, Hkv, n_pages * page_size, D] in position order."""
    kv = torch.index_select(cache, 0, pages)  # [batch * n_pages, page_size, Hkv, D]
    return kv.view(batch, -1, *cache.shape[2:]).transpose(1, 2).to(dtype)
