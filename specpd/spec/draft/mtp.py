"""MTP draft (DeepSeek-V3 style multi-token prediction / NextN), one decoder block of the target's kind.

Per module i (DeepSeek-V3 report §2.2; vLLM deepseek_mtp.py; SGLang deepseek_nextn.py):
    x = eh_proj(cat(enorm(embed(token)), hnorm(hidden)))   [2H -> H], no bias
    h = block(x)                                           a decoder layer of the target's family
    logits = head(shared_head.norm(h))
The first step's `hidden` is the target's normed final hidden (what both engines pass). The output
`h` is returned pre-norm and fed back as the next step's hidden, as in vLLM and the report (h^k is
the block output; OutHead = norm + head). SGLang instead feeds back shared_head.norm(h); with
num_nextn_predict_layers = 1 this only changes multi-step self-chaining, which the report's
training never saw either way. With N > 1 modules, draft step s uses module s % N and its own KV
layer s % N. vLLM's zeroing of the embedding at position 0 is not applied (SGLang does not either).

Published key layout (DeepSeek-V3, in the target's own checkpoint, L = num_hidden_layers + i):
    model.layers.{L}.{enorm,hnorm,eh_proj}.weight, model.layers.{L}.shared_head.norm.weight,
    model.layers.{L}.<decoder block: self_attn.*, mlp.*, input_layernorm, post_attention_layernorm>,
    model.layers.{L}.shared_head.head.weight and model.layers.{L}.embed_tokens.weight (optional).
A present shared_head.head is the module's own head; absent, the target's lm_head is bound.
embed_tokens copies are ignored (the report: MTP shares the main model's embedding), as SGLang does.
The first MTP index is found from the keys (SGLang's extracted NextN checkpoints put it at
model.layers.0), and the target's own weights in the same file (model.embed_tokens, model.norm,
lm_head, model.layers.{< first}) are skipped, so the target's checkpoint directory loads as is.
Reduced vocab (specpd extension): shared_head.head rows [draft_vocab, H] + top-level d2t, t2d.
For a DeepSeek-V3 / GLM-4.5 target the block is that family's layer (MLA or GQA attention, and a MoE: the
checkpoint's layer {num_hidden_layers + i} is past first_k_dense_replace), its KV the target's kind (latent rows
for MLA); `--speculative-algorithm mtp` with no --draft-model reads these layers from the target's own checkpoint
(specpd/spec/draft/checkpoint_mtp.py).
"""
from __future__ import annotations

import re
from typing import Any

import torch
from torch import nn

from specpd.config import ModelConfig
from specpd.spec.draft.base import DraftModel, Slot, decoder_layer_slots, draft_layer_config, hf_config_fields
from specpd.model.llama import OutputRows, RMSNorm, apply_linear, head_logits
from specpd.model.mla import split_kv_b
from specpd.model.moe_lm import layer_slots, make_block
from specpd.model.rope_scaling import make_rotary

_EH_PROJ = re.compile(r"model\.layers\.(\d+)\.eh_proj\.weight")
_LAYER = re.compile(r"model\.layers\.(\d+)\.(.+)")
_TARGET_TOP = {"model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"}


class SharedHead(nn.Module):
    def __init__(self, cfg: ModelConfig, head_rows: int | None):
        super().__init__()
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.head = nn.Linear(cfg.hidden_size, head_rows, bias=False) if head_rows else None


class MTPModule(nn.Module):
    def __init__(self, cfg: ModelConfig, index: int, head_rows: int | None, hf_layer: int):
        super().__init__()
        hidden = cfg.hidden_size
        self.enorm = RMSNorm(hidden, cfg.rms_norm_eps)
        self.hnorm = RMSNorm(hidden, cfg.rms_norm_eps)
        self.eh_proj = nn.Linear(2 * hidden, hidden, bias=False)
        # KV layer `index` of the draft pool; a block of the target's family (DeepSeek-V3 / GLM-4.5: MLA or GQA
        # attention and a MoE, as checkpoint layer `hf_layer` is)
        self.block = make_block(cfg, index, hf_layer)
        self.shared_head = SharedHead(cfg, head_rows)


class MTPDraft(DraftModel):
    algorithm = "mtp"
    uses_target_final_hidden = True

    def __init__(self, config: ModelConfig, target_config: ModelConfig, *, first_layer_index: int,
                 own_heads: tuple[bool, ...] | None = None, draft_vocab_size: int | None = None,
                 has_vocab_map: bool = False, max_positions: int | None = None):
        super().__init__(config, target_config, draft_vocab_size, has_vocab_map)
        if config.hidden_size != target_config.hidden_size:
            raise ValueError(f"MTP hidden_size {config.hidden_size} must equal the target's "
                             f"{target_config.hidden_size}")
        n = config.num_layers
        reduced = self.draft_vocab_size != target_config.vocab_size
        own_heads = own_heads or (reduced,) * n
        self.first_layer_index = first_layer_index
        self.mtp = nn.ModuleList(
            MTPModule(config, i, self.draft_vocab_size if own_heads[i] or reduced else None, first_layer_index + i)
            for i in range(n))
        self.rotary = make_rotary(config, max_positions or config.max_position_embeddings)

    @classmethod
    def from_published(cls, draft_json: dict[str, Any], keys: set[str] | None, target_config: ModelConfig,
                       max_positions: int | None = None) -> "MTPDraft":
        n = int(draft_json.get("num_nextn_predict_layers", 1))
        if keys is None:
            first = int(draft_json.get("num_hidden_layers", target_config.num_layers))
        else:
            found = sorted(int(m.group(1)) for k in keys if (m := _EH_PROJ.fullmatch(k)))
            if not found:
                raise ValueError("MTP checkpoint has no module: expected model.layers.{N}.eh_proj.weight keys")
            if found != list(range(found[0], found[0] + n)):
                raise ValueError(f"MTP checkpoint has modules at layers {found}; config num_nextn_predict_layers={n} "
                                 f"expects {n} consecutive indices")
            first = found[0]
        cfg = draft_layer_config(draft_json, target_config, n)
        own = tuple(keys is not None and f"model.layers.{first + i}.shared_head.head.weight" in keys
                    for i in range(n))
        return cls(cfg, target_config, first_layer_index=first, own_heads=own,
                   draft_vocab_size=draft_json.get("draft_vocab_size"),
                   has_vocab_map=keys is not None and "d2t" in keys, max_positions=max_positions)

    def forward(self, input_ids, hidden, positions, backend, meta, step: int = 0, rows: OutputRows | None = None):
        module = self.mtp[step % len(self.mtp)]
        x = torch.cat([module.enorm(self.embed(input_ids)), module.hnorm(hidden)], dim=-1)  # [T, 2H]
        x = apply_linear(module.eh_proj, x)
        return module.block(x, self.rotary.table(positions, x.dtype), backend, meta, rows)

    def compute_logits(self, draft_hidden, step: int = 0):
        shared_head = self.mtp[step % len(self.mtp)].shared_head
        return head_logits(shared_head.norm(draft_hidden), shared_head.head,
                           self._bound().model if shared_head.head is None else None)

    def _heads(self):
        return [(m.shared_head, "head") for m in self.mtp]

    def published_slots(self) -> dict[str, Slot]:
        slots: dict[str, Slot] = {}
        for i, module in enumerate(self.mtp):
            pub, mod = f"model.layers.{self.first_layer_index + i}.", f"mtp.{i}."
            for name in ("enorm.weight", "hnorm.weight", "eh_proj.weight", "shared_head.norm.weight"):
                slots[pub + name] = Slot(mod + name)
            if module.shared_head.head is not None:
                slots[pub + "shared_head.head.weight"] = Slot(mod + "shared_head.head.weight")
            if self.config.moe is None:
                slots.update(decoder_layer_slots(pub, mod + "block.", self.config))
            else:
                slots.update({k: Slot(name, rows) for k, (name, rows) in
                              layer_slots(pub, mod + "block.", self.config, self.first_layer_index + i).items()})
        slots.update(self._vocab_map_slots())
        return slots

    def load_published(self, weights: dict[str, torch.Tensor], source: str = "checkpoint") -> None:
        """An MLA block's kv_b_proj goes in as its per-head pieces (specpd/model/mla.py split_kv_b)."""
        super().load_published(split_kv_b(weights, self.config) if self.config.mla is not None else weights, source)

    def ignored_key(self, key: str) -> bool:
        if key in _TARGET_TOP:
            return True
        m = _LAYER.fullmatch(key)
        if m is None:
            return False
        index = int(m.group(1))
        is_mtp = self.first_layer_index <= index < self.first_layer_index + len(self.mtp)
        return index < self.first_layer_index or (is_mtp and m.group(2) == "embed_tokens.weight")

    def published_config(self) -> dict[str, Any]:
        out = hf_config_fields(self.config)
        out.update(num_hidden_layers=self.first_layer_index, num_nextn_predict_layers=len(self.mtp),
                   vocab_size=self.target_config.vocab_size)
        if self.draft_vocab_size != self.target_config.vocab_size:
            out["draft_vocab_size"] = self.draft_vocab_size
        return out
