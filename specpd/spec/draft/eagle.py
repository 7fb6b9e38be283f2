"""EAGLE-1 draft: fc over [token embedding; target hidden] + Llama decoder layer(s), target's head.

Matches the reference (SafeAILab/EAGLE eagle/model/cnets1.py, SGLang llama_eagle.py, vLLM
llama_eagle.py):
  - input: the target's normed final hidden (HF LlamaModel output, what EAGLE's ea_model passes on)
    for the first step, the draft's own output afterwards;
  - x = fc(cat(embed(token), hidden)) [2H -> H], with bias unless config.json says "bias": false
    (the reference default is bias=True);
  - layer 0 has no input_layernorm (cnets1: `if self.index != 0`); later layers have one;
  - no final norm: logits = target lm_head(draft hidden) (cnets1 `head(last_hidden)`; SGLang returns
    hidden + residual and applies the target head directly).

Published keys (pytorch_model.bin of yuhuili/EAGLE-*): fc.weight, fc.bias,
layers.{i}.self_attn.{q,k,v,o}_proj.weight (+ q/k/v bias when "qkv_bias"),
layers.{i}.mlp.{gate,up,down}_proj.weight, layers.{i}.post_attention_layernorm.weight,
layers.{i>0}.input_layernorm.weight. `embed_tokens.weight` (EAGLE's frozen copy of the target's
embedding) is accepted and ignored: the target's embedding is bound instead, as SGLang and vLLM do.
Reduced vocab (specpd extension, EAGLE-3's names): lm_head.weight [draft_vocab, H], d2t, t2d,
config "draft_vocab_size".
"""
from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch
from torch import nn

from specpd.config import ModelConfig
from specpd.spec.draft.base import DraftModel, Slot, decoder_layer_slots, draft_layer_config, hf_config_fields
from specpd.model.llama import DecoderLayer, OutputRows, Rotary, apply_linear, head_logits


class Eagle1Draft(DraftModel):
    algorithm = "eagle"
    uses_target_final_hidden = True

    def __init__(self, config: ModelConfig, target_config: ModelConfig, *, fc_bias: bool = True,
                 draft_vocab_size: int | None = None, has_vocab_map: bool = False, own_head: bool = False,
                 max_positions: int | None = None):
        super().__init__(config, target_config, draft_vocab_size, has_vocab_map)
        hidden = config.hidden_size
        if hidden != target_config.hidden_size:
            raise ValueError(f"EAGLE-1 draft hidden_size {hidden} must equal the target's "
                             f"{target_config.hidden_size} (it concatenates target embedding and hidden)")
        self.fc = nn.Linear(2 * hidden, hidden, bias=fc_bias)
        self.layers = nn.ModuleList(DecoderLayer(config, i) for i in range(config.num_layers))
        self.layers[0].input_layernorm = nn.Identity()
        self.rotary = Rotary(config, max_positions or config.max_position_embeddings)
        own_head = own_head or self.draft_vocab_size != target_config.vocab_size
        self.lm_head = nn.Linear(hidden, self.draft_vocab_size, bias=False) if own_head else None

    @classmethod
    def from_published(cls, draft_json: dict[str, Any], keys: set[str] | None, target_config: ModelConfig,
                       max_positions: int | None = None) -> "Eagle1Draft":
        num_layers = int(draft_json.get("num_hidden_layers", 1))
        # the reference layer is Llama-style whatever the target: no q/k norm, q/k/v bias per config
        cfg = replace(draft_layer_config(draft_json, target_config, num_layers), architecture="llama", qk_norm=False)
        if "bias" in draft_json:
            fc_bias = bool(draft_json["bias"])
        else:
            fc_bias = keys is None or "fc.bias" in keys
        return cls(cfg, target_config, fc_bias=fc_bias, draft_vocab_size=draft_json.get("draft_vocab_size"),
                   has_vocab_map=keys is not None and "d2t" in keys,
                   own_head=keys is not None and "lm_head.weight" in keys, max_positions=max_positions)

    def forward(self, input_ids, hidden, positions, backend, meta, step: int = 0, rows: OutputRows | None = None):
        x = apply_linear(self.fc, torch.cat([self.embed(input_ids), hidden], dim=-1))  # [T, H]
        rope = self.rotary.table(positions, x.dtype)
        last = len(self.layers) - 1
        for i, layer in enumerate(self.layers):  # the layers before the last need every row's output
            x = layer(x, rope, backend, meta, rows if i == last else None)
        return x

    def compute_logits(self, draft_hidden, step: int = 0):
        target = self._bound().model if self.lm_head is None else None
        return head_logits(draft_hidden, self.lm_head, target)

    def _heads(self):
        return [(self, "lm_head")]

    def published_slots(self) -> dict[str, Slot]:
        slots = {"fc.weight": Slot("fc.weight")}
        if self.fc.bias is not None:
            slots["fc.bias"] = Slot("fc.bias")
        for i in range(self.config.num_layers):
            slots.update(decoder_layer_slots(f"layers.{i}.", f"layers.{i}.", self.config, input_layernorm=i > 0))
        if self.lm_head is not None:
            slots["lm_head.weight"] = Slot("lm_head.weight")
        slots.update(self._vocab_map_slots())
        return slots

    def ignored_key(self, key: str) -> bool:
        return key == "embed_tokens.weight"

    def published_config(self) -> dict[str, Any]:
        out = hf_config_fields(self.config)
        out.update(architectures=["LlamaForCausalLMEagle"], bias=self.fc.bias is not None,
                   vocab_size=self.target_config.vocab_size)
        if self.config.attention_bias:
            out["qkv_bias"] = True
        if self.draft_vocab_size != self.target_config.vocab_size:
            out["draft_vocab_size"] = self.draft_vocab_size
        return out
