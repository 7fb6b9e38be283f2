"""The KV pool of a multi-head latent attention model (DeepSeek-V2/V3): one latent row per token and layer.

MLA keeps no per-head K and V: a token's cache entry is one row `[c_kv (kv_lora_rank) | k_pe (qk_rope_head_dim)]`
(the normed compressed KV, then the RoPE'd key part every head shares), `latent_dim` wide, padded by one zero
element to an even `row_width` when `latent_dim` is odd. Every query head reads the same row, so the pool is an
MQA pool of one KV head whose K and V are the same row (specpd/attention/mla.py attends over it absorbed).

The page, in memory and on the wire (PD moves it as is, one descriptor per page):
    [layer][slot][row_width]   target layers first, then a draft's (`extra_layers`, the MTP layers' rows)
so a page holds `(num_layers + extra_layers) * page_size * row_width` elements and a layer's block is
`page_size * row_width` contiguous elements. Pages, page ids, the allocator, `layers_of` and the radix cache are
KVPool's: this class is a KVPool whose geometry is one "KV head" of `row_width / 2` dims, and whose `buffer`
(the logical view `[num_pages, layers, 2, page_size, 1, row_width / 2]` every pool-wide byte operation uses:
tree-path compaction, kv_layout's placements and transfers) splits each row into two halves in the K / V slots.
Only those byte operations see that split; attention reads whole rows through `latent(layer)` (`k_cache` and
`v_cache` are both that row). Under tensor parallelism every rank would hold every row (the latent is shared by
all heads, nothing to split by head); specpd refuses --tp-size > 1 for MLA (specpd/model/tp.py).
"""
from __future__ import annotations

import torch

from specpd.config import ModelConfig
from specpd.kv.allocator import PageAllocator
from specpd.kv.pool import KVPool


def wire_layout(latent_dim: int) -> str:
    """PeerConfig.kv_layout of a server whose pool holds latent rows of `latent_dim`: P and D must lay pages out
    alike (specpd/disagg/messages.py refuses a pair that differs, naming both)."""
    pad = latent_dim % 2
    return f"mla latent page[layer][slot][row {latent_dim}{' + 1 pad' if pad else ''}], every row on every rank"


def model_wire_layout(cfg) -> str | None:
    """The wire layout of `cfg`'s pool when it is a latent one (an MLA model), else None."""
    mla = getattr(cfg, "mla", None)
    return None if mla is None else wire_layout(mla.latent_dim)


class LatentKVPool(KVPool):
    def __init__(self, num_pages: int, num_layers: int, page_size: int, latent_dim: int, dtype: torch.dtype,
                 device: str | torch.device = "cpu", allocator: PageAllocator | None = None, extra_layers: int = 0):
        self.latent_dim = latent_dim
        row_width = latent_dim + latent_dim % 2
        super().__init__(num_pages, num_layers, page_size, 1, row_width // 2, dtype, device, allocator, extra_layers)

    @property
    def row_width(self) -> int:
        return 2 * self.head_dim

    @property
    def wire_layout(self) -> str:
        return wire_layout(self.latent_dim)

    def _view(self, first_layer: int, num_layers: int) -> torch.Tensor:
        """[num_pages, num_layers, 2, page_size, 1, row_width / 2] over rows [layer][slot][row_width]: the K / V
        slots are a row's two halves (module docstring)."""
        half, layer = self.head_dim, self.page_size * self.row_width
        return self.storage.as_strided(
            (self.num_pages, num_layers, 2, self.page_size, 1, half),
            (self.storage.stride(0), layer, half, self.row_width, self.row_width, 1),
            self.storage.storage_offset() + first_layer * layer)

    @classmethod
    def layers_of(cls, parent: "LatentKVPool") -> "LatentKVPool":
        view = super().layers_of(parent)
        view.latent_dim = parent.latent_dim
        return view

    @staticmethod
    def page_bytes(cfg: ModelConfig, page_size: int, dtype: torch.dtype, extra_layers: int = 0) -> int:
        width = cfg.mla.latent_dim + cfg.mla.latent_dim % 2
        return (cfg.num_layers + extra_layers) * page_size * width * torch.tensor([], dtype=dtype).element_size()

    @classmethod
    def for_model(cls, cfg: ModelConfig, page_size: int, dtype: torch.dtype, device="cpu",
                  memory_mb: int = 512, num_pages: int | None = None, extra_layers: int = 0) -> "LatentKVPool":
        if num_pages is None:
            num_pages = max(1, (memory_mb << 20) // cls.page_bytes(cfg, page_size, dtype, extra_layers))
        return cls(num_pages, cfg.num_layers, page_size, cfg.mla.latent_dim, dtype, device, extra_layers=extra_layers)

    def latent(self, layer: int) -> torch.Tensor:
        """[num_pages, page_size, row_width], strided over the pages: layer `layer`'s rows."""
        b = self.buffer
        return b.as_strided((self.num_pages, self.page_size, self.row_width), (b.stride(0), self.row_width, 1),
                            b.storage_offset() + layer * b.stride(1))

    def k_cache(self, layer: int) -> torch.Tensor:
        return self.latent(layer).unsqueeze(2)  # [num_pages, page_size, 1, row_width]: keys are whole rows

    def v_cache(self, layer: int) -> torch.Tensor:
        return self.latent(layer).unsqueeze(2)  # values are the rows too (their c_kv part is what is kept)

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor, pages: torch.Tensor,
              offsets: torch.Tensor) -> None:
        """k: the step's rows [num_tokens, 1, row_width] (v is the same rows, already written with k)."""
        self.latent(layer)[pages, offsets] = k[:, 0].to(self.dtype)
