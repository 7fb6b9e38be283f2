"""The KV pool tensor, page-major: one page is one contiguous block holding every layer's K and V.

Layout `[num_pages, num_layers, 2, page_size, kv_heads, head_dim]` (DESIGN.md §3): a transfer engine
moves one descriptor per page. Per-layer K and V are strided views `[num_pages, page_size, kv_heads, head_dim]`.
"""
from __future__ import annotations

import torch

from specpd.config import ModelConfig
from specpd.kv.allocator import PageAllocator

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class KVPool:
    def __init__(self, num_pages: int, num_layers: int, page_size: int, kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: str | torch.device = "cpu", allocator: PageAllocator | None = None):
        """`allocator`: share another pool's page ids (the draft pool mirrors the target's pages)."""
        self.num_pages = num_pages
        self.num_layers = num_layers
        self.page_size = page_size
        self.kv_heads = kv_heads
        self.head_dim = head_dim
        self.dtype = dtype
        # [num_pages, num_layers, 2, page_size, kv_heads, head_dim]
        self.buffer = torch.zeros(num_pages, num_layers, 2, page_size, kv_heads, head_dim,
                                  dtype=dtype, device=device)
        self.allocator = allocator or PageAllocator(num_pages)

    @staticmethod
    def page_bytes(cfg: ModelConfig, page_size: int, dtype: torch.dtype) -> int:
        return cfg.num_layers * 2 * page_size * cfg.kv_size * torch.tensor([], dtype=dtype).element_size()

    @classmethod
    def for_model(cls, cfg: ModelConfig, page_size: int, dtype: torch.dtype, device="cpu",
                  memory_mb: int = 512, num_pages: int | None = None) -> "KVPool":
        if num_pages is None:
            num_pages = max(1, (memory_mb << 20) // cls.page_bytes(cfg, page_size, dtype))
        return cls(num_pages, cfg.num_layers, page_size, cfg.num_kv_heads, cfg.head_dim, dtype, device)

    @property
    def bytes_per_page(self) -> int:
        return self.buffer[0].numel() * self.buffer.element_size()

    def k_cache(self, layer: int) -> torch.Tensor:
        return self.buffer[:, layer, 0]  # [num_pages, page_size, kv_heads, head_dim], strided

    def v_cache(self, layer: int) -> torch.Tensor:
        return self.buffer[:, layer, 1]

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor,
              pages: torch.Tensor, offsets: torch.Tensor) -> None:
        """k, v: [num_tokens, kv_heads, head_dim]; pages, offsets: [num_tokens] int64."""
        self.buffer[pages, layer, 0, offsets] = k.to(self.dtype)
        self.buffer[pages, layer, 1, offsets] = v.to(self.dtype)
