"""Attention metadata in fixed buffers, for forwards replayed from CUDA graphs (specpd/model/cuda_graphs.py).

A graph reads the same device memory on every replay, so a batch it runs is laid out in a fixed shape and
written into buffers allocated once:
  1. `pad_layout` (host lists only): `bucket` requests of `width` query rows each. Request b owns rows
     b * width .. (b + 1) * width - 1, its real rows first, then pad rows; requests past the batch are pad
     requests. A real request's KV length grows by its pad rows, so its real rows keep their positions (query j
     sits at kv_len - width + j). Pad rows and pad requests write their K/V to one scratch slot (a page that no
     request owns), read only pages of their own request or the scratch page, and no real row sees them: they
     come after every real row (causal), or are False in its tree block.
  2. `StaticMetadata.load`: the layout copied into buffers allocated at the largest bucket; a bucket's tensors
     are prefix views of them, so every step, and every bucket, reads the same storage. It returns an
     AttentionMetadata whose tensors are those views.
  3. The backend's `plan_static(meta, max_kv_len)` plans into fixed buffers of its own
     (specpd/attention/base.py).
The same path runs without capture (the CPU tests check everything in it but the replay).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from specpd.attention.metadata import AttentionMetadata


@dataclass
class PaddedLayout:
    """One batch in a graph's shape (host lists). Tree blocks: as AttentionMetadata's, [width, mask_width] each."""

    bucket: int  # requests, pad requests included
    width: int  # query rows per request
    mask_width: int  # tree block columns per request; 0: causal, no tree masks
    kv_lens: list[int]  # [bucket] KV length of each request, its pad rows included
    page_rows: list[list[int]]  # [bucket][pages] the pages each request's KV positions read
    write_pages: list[int]  # [bucket * width] page each row writes its K/V to
    write_offsets: list[int]  # [bucket * width] slot in that page
    tree_mask: torch.Tensor | None  # [bucket, width, mask_width] bool, or None (causal)
    real_rows: list[int]  # [real rows] padded row of each row of the batch, in the batch's order
    last_rows: list[int]  # [bucket] each request's last real row (a pad request: its last row)
    last_kv_lens: list[int]  # [bucket] the KV length a request's last real row sees (a pad request: 1)
    last_write_pages: list[int]  # [bucket] the slot that last row wrote (a pad request: the scratch slot)
    last_write_offsets: list[int]

    @property
    def num_real(self) -> int:
        return len(self.real_rows)


def pad_layout(q_lens: list[int], kv_lens: list[int], page_lists: list[list[int]],
               tree_masks: list[torch.Tensor | None] | None, bucket: int, width: int, page_size: int,
               max_pages: int, scratch_page: int) -> PaddedLayout | None:
    """The batch padded to `bucket` requests of `width` rows, or None where it does not fit (more requests or
    rows, a KV length past max_pages pages, a tree block that would reach before position 0)."""
    n = len(q_lens)
    if n > bucket or max(q_lens) > width:
        return None
    masks = tree_masks if tree_masks is not None and any(m is not None for m in tree_masks) else None
    mask_width = 0
    if masks is not None:  # every block covers its request's pad rows and the widest block's scratch slots
        mask_width = width + max((m.shape[1] - q if m is not None else 0) for m, q in zip(masks, q_lens))
    pad_kv = max(width, mask_width)
    kv_pad = [kv + width - q for q, kv in zip(q_lens, kv_lens)] + [pad_kv] * (bucket - n)
    if any(-(-kv // page_size) > max_pages for kv in kv_pad) or any(kv < mask_width for kv in kv_pad):
        return None
    page_rows, write_pages, write_offsets, real_rows = [], [], [], []
    last_rows, last_kv, last_pages, last_offsets = [], [], [], []
    for b, (q, kv, pages) in enumerate(zip(q_lens, kv_lens, page_lists)):
        page_rows.append(pages[:-(-kv_pad[b] // page_size)])
        for pos in range(kv - q, kv):
            write_pages.append(pages[pos // page_size])
            write_offsets.append(pos % page_size)
        write_pages.extend([scratch_page] * (width - q))
        write_offsets.extend([0] * (width - q))
        real_rows.extend(range(b * width, b * width + q))
        last_rows.append(b * width + q - 1)
        last_kv.append(kv)
        last_pages.append(pages[(kv - 1) // page_size])
        last_offsets.append((kv - 1) % page_size)
    for b in range(n, bucket):
        page_rows.append([scratch_page])
        write_pages.extend([scratch_page] * width)
        write_offsets.extend([0] * width)
        last_rows.append(b * width + width - 1)
        last_kv.append(1)
        last_pages.append(scratch_page)
        last_offsets.append(0)
    tree = None if masks is None else _tree_blocks(q_lens, kv_lens, kv_pad, masks, bucket, width, mask_width)
    return PaddedLayout(bucket, width, mask_width, kv_pad, page_rows, write_pages, write_offsets, tree, real_rows,
                        last_rows, last_kv, last_pages, last_offsets)


def _tree_blocks(q_lens, kv_lens, kv_pad, masks, bucket: int, width: int, mask_width: int) -> torch.Tensor:
    """[bucket, width, mask_width] bool. Column c of request b is position kv_pad[b] - mask_width + c. A real row
    sees what its own block (or, without one, causality) lets it see before its request's pad positions, and none
    of those; a pad row sees the positions before the block and itself (the diagonal of the last `width`
    columns, which AttentionMetadata requires)."""
    blocks = torch.zeros(bucket, width, mask_width, dtype=torch.bool)
    own = torch.arange(width)
    blocks[:, own, mask_width - width + own] = True
    for b, (q, kv, mask) in enumerate(zip(q_lens, kv_lens, masks)):
        real = mask if mask is not None else torch.ones(q, q, dtype=torch.bool).tril()
        start = kv_pad[b] - mask_width  # position of column 0
        block_col = kv - real.shape[1] - start  # column of the real block's first position (>= 0)
        blocks[b, :, :block_col] = True
        blocks[b, :q, block_col:block_col + real.shape[1]] = real.to("cpu")
        blocks[b, q:, block_col:block_col + real.shape[1]] = False
        blocks[b, own[q:], mask_width - width + own[q:]] = True
    return blocks


class StaticMetadata:
    """AttentionMetadata buffers sized for `max_bs` requests of up to `max_width` rows, `max_pages` pages and
    `max_mask_cells` tree-mask entries each, on `device`; `load` fills a prefix of them and views it."""

    def __init__(self, max_bs: int, max_width: int, max_pages: int, max_mask_cells: int, page_size: int,
                 device: torch.device):
        i32, i64 = dict(dtype=torch.int32, device=device), dict(dtype=torch.int64, device=device)
        self.max_bs, self.max_width, self.max_pages, self.page_size = max_bs, max_width, max_pages, page_size
        self.qo_indptr = torch.zeros(max_bs + 1, **i32)  # [max_bs + 1]
        self.kv_lens = torch.zeros(max_bs, **i32)  # [max_bs]
        self.page_table = torch.zeros(max_bs, max_pages, **i32)  # [max_bs, max_pages]
        self.write_pages = torch.zeros(max_bs * max_width, **i64)  # [max_bs * max_width]
        self.write_offsets = torch.zeros(max_bs * max_width, **i64)
        self.tree_mask = torch.zeros(max(1, max_bs * max_mask_cells), dtype=torch.bool, device=device)
        self.tree_mask_indptr = torch.zeros(max_bs + 1, **i32)  # [max_bs + 1]

    def fits(self, layout: PaddedLayout) -> bool:
        return (layout.bucket <= self.max_bs and layout.width <= self.max_width
                and layout.bucket * layout.width * layout.mask_width <= self.tree_mask.numel())

    def load(self, layout: PaddedLayout) -> AttentionMetadata:
        """The layout in these buffers; its tensors are views of them (the same storage for every batch)."""
        bs, w, mw = layout.bucket, layout.width, layout.mask_width
        rows = bs * w
        _put(self.qo_indptr[:bs + 1], list(range(0, rows + 1, w)))
        _put(self.kv_lens[:bs], layout.kv_lens)
        cols = max(len(r) for r in layout.page_rows)
        # columns past a request's KV keep older page ids: no kernel reads past kv_len, and the static torch
        # plan masks them (any page id there is a valid one)
        table = [r + [r[-1]] * (cols - len(r)) for r in layout.page_rows]
        self.page_table[:bs, :cols].copy_(torch.tensor(table, dtype=torch.int32), non_blocking=True)
        _put(self.write_pages[:rows], layout.write_pages)
        _put(self.write_offsets[:rows], layout.write_offsets)
        tree_mask = tree_indptr = None
        if layout.tree_mask is not None:
            tree_mask = self.tree_mask[:rows * mw]
            tree_mask.copy_(layout.tree_mask.reshape(-1), non_blocking=True)
            tree_indptr = self.tree_mask_indptr[:bs + 1]
            _put(tree_indptr, list(range(0, rows * mw + 1, w * mw)))
        return AttentionMetadata(
            qo_indptr=self.qo_indptr[:bs + 1], kv_lens=self.kv_lens[:bs], page_table=self.page_table[:bs],
            write_pages=self.write_pages[:rows], write_offsets=self.write_offsets[:rows],
            q_lens_host=[w] * bs, kv_lens_host=list(layout.kv_lens), page_size=self.page_size,
            tree_mask=tree_mask, tree_mask_indptr=tree_indptr)

    def load_last_rows(self, layout: PaddedLayout) -> AttentionMetadata:
        """One query row per request: its last real row, over the KV it sees (OutputRows' metadata)."""
        bs = layout.bucket
        _put(self.qo_indptr[:bs + 1], list(range(bs + 1)))
        _put(self.kv_lens[:bs], layout.last_kv_lens)
        pages = [r[:-(-kv // self.page_size)] for r, kv in zip(layout.page_rows, layout.last_kv_lens)]
        cols = max(len(r) for r in pages)
        table = [r + [r[-1]] * (cols - len(r)) for r in pages]
        self.page_table[:bs, :cols].copy_(torch.tensor(table, dtype=torch.int32), non_blocking=True)
        _put(self.write_pages[:bs], layout.last_write_pages)
        _put(self.write_offsets[:bs], layout.last_write_offsets)
        return AttentionMetadata(
            qo_indptr=self.qo_indptr[:bs + 1], kv_lens=self.kv_lens[:bs], page_table=self.page_table[:bs],
            write_pages=self.write_pages[:bs], write_offsets=self.write_offsets[:bs], q_lens_host=[1] * bs,
            kv_lens_host=list(layout.last_kv_lens), page_size=self.page_size)


def _put(dst: torch.Tensor, values: list[int]) -> None:
    dst.copy_(torch.tensor(values, dtype=dst.dtype), non_blocking=True)


def write_slots(layout: PaddedLayout, page_size: int) -> list[int]:
    """Every slot (page * page_size + offset) the layout's rows write, the scratch slot included."""
    return [p * page_size + o for p, o in zip(layout.write_pages, layout.write_offsets)]
