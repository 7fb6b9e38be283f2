"""Per-batch attention metadata, built once per step by the model runner and shared by all layers."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch


@dataclass
class AttentionMetadata:
    """Query tokens of all sequences are concatenated ("ragged") along dim 0.

    Query j (0-based) of sequence b sits at KV position kv_lens[b] - q_lens[b] + j. The new tokens'
    K/V are written (at write_pages/write_offsets) before attention runs. Every query attends to the
    whole prefix; then
    - without a tree mask: the new tokens causally (new tokens 0..j);
    - with one: tree_b = tree_mask[tree_mask_indptr[b]:tree_mask_indptr[b + 1]].view(q_len_b, width_b)
      (row-major, row = query, width_b >= q_len_b) covers the last width_b KV positions, and query j
      sees position kv_len - width_b + i iff tree_b[j, i]; everything before them is visible.
      Tree verify uses width == q_len (the ancestor-or-self relation of the tree's nodes, diagonal
      True; a lower-triangular block is exactly causal). Tree drafting uses a wider block: a draft
      step's queries also see the scratch slots of their ancestors from earlier steps.
    A tree's nodes occupy consecutive scratch slots after the committed prefix, in any order.
    """

    qo_indptr: torch.Tensor  # [batch + 1] int32, offsets of each sequence's queries
    kv_lens: torch.Tensor  # [batch] int32, KV length per sequence including this step's tokens
    page_table: torch.Tensor  # [batch, max_pages] int32, page ids per sequence (padding 0)
    write_pages: torch.Tensor  # [num_tokens] int64, page receiving each new token's K/V
    write_offsets: torch.Tensor  # [num_tokens] int64, slot inside that page
    q_lens_host: list[int]
    kv_lens_host: list[int]
    page_size: int
    # None when no sequence has a tree. Otherwise the per-sequence blocks flattened row-major and
    # concatenated in batch order; a sequence without a tree has an empty block (causal).
    tree_mask: torch.Tensor | None = None  # [sum over tree sequences of q_len_b * width_b] bool
    tree_mask_indptr: torch.Tensor | None = None  # [batch + 1] int32, offsets of each block in tree_mask
    plan: Any = None  # backend-specific state from AttentionBackend.plan

    @property
    def batch_size(self) -> int:
        return len(self.q_lens_host)

    @property
    def is_decode(self) -> bool:
        return all(q == 1 for q in self.q_lens_host)

    @property
    def max_q_len(self) -> int:
        return max(self.q_lens_host)

    @property
    def max_kv_len(self) -> int:
        return max(self.kv_lens_host)

    @classmethod
    def build(cls, q_lens: list[int], kv_lens: list[int], page_lists: list[list[int]],
              page_size: int, device: str | torch.device = "cpu",
              tree_masks: list[torch.Tensor | None] | None = None) -> "AttentionMetadata":
        """Host-side construction from plain lists (what the scheduler knows).

        tree_masks: one entry per sequence, None (causal) or a [q_len_b, width_b >= q_len_b] bool
        tensor over the last width_b KV positions (see the class docstring).
        """
        indptr = [0]
        for q in q_lens:
            indptr.append(indptr[-1] + q)
        max_pages = max(len(p) for p in page_lists)
        table = [p + [0] * (max_pages - len(p)) for p in page_lists]
        write_pages: list[int] = []
        write_offsets: list[int] = []
        for q, kv, pages in zip(q_lens, kv_lens, page_lists):
            for pos in range(kv - q, kv):
                write_pages.append(pages[pos // page_size])
                write_offsets.append(pos % page_size)
        i32 = dict(dtype=torch.int32, device=device)
        i64 = dict(dtype=torch.int64, device=device)
        tree_mask, tree_mask_indptr = _flatten_tree_masks(tree_masks, q_lens, device)
        return cls(
            qo_indptr=torch.tensor(indptr, **i32),
            kv_lens=torch.tensor(kv_lens, **i32),
            page_table=torch.tensor(table, **i32),
            write_pages=torch.tensor(write_pages, **i64),
            write_offsets=torch.tensor(write_offsets, **i64),
            q_lens_host=list(q_lens),
            kv_lens_host=list(kv_lens),
            page_size=page_size,
            tree_mask=tree_mask,
            tree_mask_indptr=tree_mask_indptr,
        )


def _flatten_tree_masks(tree_masks: list[torch.Tensor | None] | None, q_lens: list[int],
                        device: str | torch.device) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """Per-sequence masks -> (tree_mask [total] bool, tree_mask_indptr [batch + 1] int32), or (None, None)."""
    if tree_masks is None or all(m is None for m in tree_masks):
        return None, None
    if len(tree_masks) != len(q_lens):
        raise ValueError(f"tree_masks has {len(tree_masks)} entries for a batch of {len(q_lens)} sequences")
    blocks: list[torch.Tensor] = []
    indptr = [0]
    for b, (mask, q_len) in enumerate(zip(tree_masks, q_lens)):
        if mask is not None:
            if mask.dtype != torch.bool or mask.dim() != 2 or mask.shape[0] != q_len or mask.shape[1] < q_len:
                raise ValueError(f"tree_masks[{b}] must be a [{q_len}, width >= {q_len}] bool tensor (q_len of "
                                 f"sequence {b}); got {mask.dtype} {tuple(mask.shape)}")
            if not bool(mask[:, mask.shape[1] - q_len:].diagonal().all()):
                raise ValueError(f"tree_masks[{b}] has a False diagonal entry: every tree node attends to itself")
            blocks.append(mask.reshape(-1).to("cpu"))
        indptr.append(indptr[-1] + (mask.numel() if mask is not None else 0))
    return (torch.cat(blocks).to(device),
            torch.tensor(indptr, dtype=torch.int32, device=device))
