"""Per-batch attention metadata, built once per step by the model runner and shared by all layers."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch


@dataclass
class AttentionMetadata:
    """Query tokens of all sequences are concatenated ("ragged") along dim 0.

    Query j (0-based) of sequence b sits at absolute position kv_lens[b] - q_lens[b] + j and attends
    causally to KV positions <= that. The new tokens' K/V are written before attention runs.
    """

    qo_indptr: torch.Tensor  # [batch + 1] int32, offsets of each sequence's queries
    kv_lens: torch.Tensor  # [batch] int32, KV length per sequence including this step's tokens
    page_table: torch.Tensor  # [batch, max_pages] int32, page ids per sequence (padding 0)
    write_pages: torch.Tensor  # [num_tokens] int64, page receiving each new token's K/V
    write_offsets: torch.Tensor  # [num_tokens] int64, slot inside that page
    q_lens_host: list[int]
    kv_lens_host: list[int]
    page_size: int
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
              page_size: int, device: str | torch.device = "cpu") -> "AttentionMetadata":
        """Host-side construction from plain lists (what the scheduler knows)."""
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
        return cls(
            qo_indptr=torch.tensor(indptr, **i32),
            kv_lens=torch.tensor(kv_lens, **i32),
            page_table=torch.tensor(table, **i32),
            write_pages=torch.tensor(write_pages, **i64),
            write_offsets=torch.tensor(write_offsets, **i64),
            q_lens_host=list(q_lens),
            kv_lens_host=list(kv_lens),
            page_size=page_size,
        )
