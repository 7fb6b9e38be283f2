"""The KV pool tensor, page-major: one page is one contiguous block holding every layer's K and V.

In memory (`storage`, [num_pages, page elements]) a page is the pool's own layers `[kv_heads, num_layers, 2,
page_size, head_dim]`, then, where a draft model's KV geometry matches, the draft's layers `[kv_heads,
extra_layers, 2, page_size, head_dim]` (`KVPool.layers_of` views them). Heads are outside layers and positions
(docs/architecture.md §4): any range of a page's KV heads, of the target's layers or of the draft's, is one contiguous
block, so a transfer moves one descriptor per page and overlapping head range (specpd/disagg/kv_layout.py)
whatever the tensor-parallel sizes of the two sides, and a whole page (target and draft) is one block too.
Code indexes the logical view `buffer` `[num_pages, num_layers, 2, page_size, kv_heads, head_dim]` (strided over
storage); per-layer K and V are strided views `[num_pages, page_size, kv_heads, head_dim]`, and every kernel takes
the page, position and head strides from them.
"""
from __future__ import annotations

import torch

from specpd.config import ModelConfig
from specpd.kv.allocator import PageAllocator
from specpd.machine import first_touch_on_huge_pages

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class KVPool:
    def __init__(self, num_pages: int, num_layers: int, page_size: int, kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: str | torch.device = "cpu", allocator: PageAllocator | None = None,
                 extra_layers: int = 0):
        """`allocator`: share another pool's page ids (the draft pool mirrors the target's pages).
        `extra_layers`: room after this pool's layers in every page for a draft's (`layers_of`)."""
        self.num_pages = num_pages
        self.num_layers = num_layers
        self.extra_layers = extra_layers
        self.page_size = page_size
        self.kv_heads = kv_heads
        self.head_dim = head_dim
        self.dtype = dtype
        shape = (num_pages, kv_heads * (num_layers + extra_layers) * 2 * page_size * head_dim)
        if torch.device(device).type == "cpu":  # zeroed on huge pages while they come cheap (machine.py)
            self.storage = torch.empty(shape, dtype=dtype)
            flat = self.storage.view(-1).view(torch.uint8)
            first_touch_on_huge_pages(flat.data_ptr(), flat.numel(), lambda at, n: flat[at:at + n].zero_())
        else:
            self.storage = torch.zeros(shape, dtype=dtype, device=device)
        self.buffer = self._view(0, num_layers)
        self.allocator = allocator or PageAllocator(num_pages)

        self.parent: KVPool | None = None  # set on a `layers_of` view

    def _view(self, first_layer: int, num_layers: int) -> torch.Tensor:
        """[num_pages, num_layers, 2, page_size, kv_heads, head_dim] over the block of layers starting at
        `first_layer` of every page (that block is [kv_heads, num_layers, 2, page_size, head_dim])."""
        block = 2 * self.page_size * self.head_dim
        return self.storage.as_strided(
            (self.num_pages, num_layers, 2, self.page_size, self.kv_heads, self.head_dim),
            (self.storage.stride(0), block, self.page_size * self.head_dim, self.head_dim, num_layers * block, 1),
            self.storage.storage_offset() + self.kv_heads * first_layer * block)

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
        return cls(num_pages, cfg.num_layers, page_size, cfg.num_kv_heads, cfg.head_dim, dtype, device,
                   extra_layers=extra_layers)

    @classmethod
    def layers_of(cls, parent: "KVPool") -> "KVPool":
        """A pool over the draft's layers of `parent`'s pages (its `extra_layers`): the same page ids, allocator
        and memory (its `buffer` is a strided view of parent.storage)."""
        if not parent.extra_layers:
            raise ValueError(f"a {parent.num_layers}-layer pool keeps no room for a draft's layers")
        view = cls.__new__(cls)
        view.num_pages, view.num_layers, view.extra_layers = parent.num_pages, parent.extra_layers, 0
        view.page_size, view.kv_heads, view.head_dim, view.dtype = (parent.page_size, parent.kv_heads,
                                                                    parent.head_dim, parent.dtype)
        view.storage = parent.storage  # whole pages: the parent's memory
        view.buffer = view._view(parent.num_layers, parent.extra_layers)
        view.allocator = parent.allocator
        view.parent = parent
        return view

    @property
    def bytes_per_page(self) -> int:
        """This pool's layers of a page."""
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
