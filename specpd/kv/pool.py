"""The KV pool tensor, page-major: one page is one contiguous block holding every layer's K and V.

In memory (`storage`) a page is `[kv_heads, num_layers, 2, page_size, head_dim]`: heads outside layers and
positions (DESIGN.md §3, §7b), so any range of a page's KV heads is one contiguous block and a transfer moves
one descriptor per page and head range (specpd/disagg/kv_layout.py), whatever the tensor-parallel sizes of the
two sides. Code indexes the logical view `buffer` `[num_pages, num_layers, 2, page_size, kv_heads, head_dim]`
(a permutation of storage); per-layer K and V are strided views `[num_pages, page_size, kv_heads, head_dim]`,
and every kernel takes the page, position and head strides from them.
A draft model whose KV geometry matches the target's keeps its layers in the same page block, after the
target's in each head's block (`extra_layers`, then `KVPool.layers_of`): one descriptor per page and head range
moves target and draft KV.
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
        # storage [num_pages, kv_heads, num_layers, 2, page_size, head_dim] (contiguous: what a transfer registers);
        # buffer: the same memory as [num_pages, num_layers, 2, page_size, kv_heads, head_dim]
        self.storage = torch.zeros(num_pages, kv_heads, num_layers, 2, page_size, head_dim, dtype=dtype,
                                   device=device)
        self.buffer = self.storage.permute(0, 2, 3, 4, 1, 5)
        self.allocator = allocator or PageAllocator(num_pages)

        self.parent: KVPool | None = None  # set on a `layers_of` view

    @staticmethod
    def page_bytes(cfg: ModelConfig, page_size: int, dtype: torch.dtype, extra_layers: int = 0) -> int:
        layers = cfg.num_layers + extra_layers
        return layers * 2 * page_size * cfg.kv_size * torch.tensor([], dtype=dtype).element_size()

    @classmethod
    def for_model(cls, cfg: ModelConfig, page_size: int, dtype: torch.dtype, device="cpu",
                  memory_mb: int = 512, num_pages: int | None = None, extra_layers: int = 0) -> "KVPool":
        """`extra_layers`: room in every page for a draft's layers (same kv heads, head dim and dtype)."""
        if num_pages is None:
            num_pages = max(1, (memory_mb << 20) // cls.page_bytes(cfg, page_size, dtype, extra_layers))
        return cls(num_pages, cfg.num_layers + extra_layers, page_size, cfg.num_kv_heads, cfg.head_dim, dtype,
                   device)

    @classmethod
    def layers_of(cls, parent: "KVPool", first_layer: int, num_layers: int) -> "KVPool":
        """A pool over layers [first_layer, first_layer + num_layers) of `parent`'s pages: the same page ids,
        allocator and memory (its `buffer` is a strided view; its layer 0 is the parent's `first_layer`)."""
        if not 0 <= first_layer <= first_layer + num_layers <= parent.num_layers:
            raise ValueError(f"layers {first_layer}..{first_layer + num_layers - 1} are not in a "
                             f"{parent.num_layers}-layer pool")
        view = cls.__new__(cls)
        view.num_pages, view.num_layers, view.page_size = parent.num_pages, num_layers, parent.page_size
        view.kv_heads, view.head_dim, view.dtype = parent.kv_heads, parent.head_dim, parent.dtype
        view.buffer = parent.buffer[:, first_layer:first_layer + num_layers]
        view.storage = parent.storage  # whole pages: the parent's memory
        view.allocator = parent.allocator
        view.parent = parent
        return view

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
