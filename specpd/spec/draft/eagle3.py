"""EAGLE-3 draft: fused low/mid/high target hiddens, a 2H-input midlayer, own norm + draft-vocab head.

Matches the reference (SafeAILab/EAGLE eagle/model/cnets.py, SGLang llama_eagle3.py):
  - first step: hidden = fc(cat(aux hiddens)) [3H -> H] (no bias unless config "bias": true); later
    steps feed the draft's own output [T, H] and skip fc (fc applies only when the last dim is not H);
  - midlayer: residual = hidden; attention input = cat(input_layernorm(embed), hidden_norm(hidden))
    [2H] so q/k/v project from 2H; then post_attention_layernorm + MLP with residuals;
  - the forward output is pre-norm (it is what the next step feeds back); logits = lm_head(norm(h));
  - `norm_before_residual: true` (speculators configs) takes the residual after hidden_norm.

Aux layers: `aux_layer_ids` are target layer INPUT indices, i.e. what CausalLM.forward's
capture_layers takes. Default (2, L//2, L-3) as in the reference (modeling_llama_kv.py captures the
hidden before layers 2, L//2, L-3), SGLang and vLLM. Overrides, each in its engine's convention:
  - top-level `eagle_aux_hidden_state_layer_ids` (vLLM / speculators): layer input indices, as is;
  - `eagle_config.eagle_aux_hidden_state_layer_ids` (SGLang / SpecForge): layer OUTPUT indices,
    SGLang captures them at layer id+1, so we add 1.
Both present and disagreeing is an error. The fused order is ascending layer order (what both the
reference and SGLang concatenate, whatever order the config lists).

Published keys (yuhuili/EAGLE3-*, SpecForge): fc.weight, midlayer.self_attn.{q,k,v,o}_proj.weight,
midlayer.{input_layernorm,hidden_norm,post_attention_layernorm}.weight,
midlayer.mlp.{gate,up,down}_proj.weight, norm.weight, lm_head.weight [draft_vocab, H],
d2t [draft_vocab] int64, t2d [vocab] bool. The embedding is the target's (the reference saves
without frozen params) unless the checkpoint carries `embed_tokens.weight` with a hidden size that
differs from the target's (`target_hidden_size` configs), which the reference then uses as its own.
"""
from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch
from torch import nn

from specpd.config import ModelConfig
from specpd.spec.draft.base import DraftModel, Slot, decoder_layer_slots, draft_layer_config, hf_config_fields
from specpd.model.llama import MLP, Attention, OutputRows, RMSNorm, Rotary, apply_linear, head_logits


class Eagle3MidLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, norm_before_residual: bool):
        super().__init__()
        hidden = cfg.hidden_size
        self.norm_before_residual = norm_before_residual
        self.input_layernorm = RMSNorm(hidden, cfg.rms_norm_eps)
        self.hidden_norm = RMSNorm(hidden, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, layer_id=0)
        self.self_attn.qkv_proj = nn.Linear(2 * hidden, cfg.q_size + 2 * cfg.kv_size, bias=cfg.attention_bias)
        self.post_attention_layernorm = RMSNorm(hidden, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, embeds, hidden, rope, backend, meta, rows: OutputRows | None = None):
        normed = self.hidden_norm(hidden)
        residual = normed if self.norm_before_residual else hidden
        x = torch.cat([self.input_layernorm(embeds), normed], dim=-1)  # [T, 2H]
        if rows is not None:
            residual = residual[rows.index]
        h = residual + self.self_attn(x, rope, backend, meta, rows)
        return h + self.mlp(self.post_attention_layernorm(h))


def resolve_aux_layer_ids(draft_json: dict[str, Any], num_target_layers: int) -> tuple[int, ...]:
    top = draft_json.get("eagle_aux_hidden_state_layer_ids")
    nested = (draft_json.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    from_nested = [int(i) + 1 for i in nested] if nested else None
    if top and from_nested and sorted(int(i) for i in top) != sorted(from_nested):
        raise ValueError(f"EAGLE-3 config: eagle_aux_hidden_state_layer_ids {list(top)} (layer inputs) "
                         f"disagrees with eagle_config.eagle_aux_hidden_state_layer_ids {list(nested)} "
                         f"(layer outputs, i.e. inputs {from_nested})")
    if top:
        ids = [int(i) for i in top]
    elif from_nested:
        ids = from_nested
    else:
        ids = [2, num_target_layers // 2, num_target_layers - 3]
    if len(set(ids)) != len(ids) or min(ids) < 0 or max(ids) >= num_target_layers:
        raise ValueError(f"EAGLE-3 aux layer ids {ids} (target layer inputs) must be distinct and in "
                         f"[0, {num_target_layers}) for a {num_target_layers}-layer target; set "
                         f"eagle_aux_hidden_state_layer_ids in the draft config.json")
    return tuple(sorted(ids))


class Eagle3Draft(DraftModel):
    algorithm = "eagle3"
    uses_target_final_hidden = False

    def __init__(self, config: ModelConfig, target_config: ModelConfig, *, aux_layer_ids: tuple[int, ...],
                 fc_bias: bool = False, draft_vocab_size: int | None = None, has_vocab_map: bool = True,
                 own_head: bool = True, own_embed: bool = False, norm_before_residual: bool = False,
                 max_positions: int | None = None):
        super().__init__(config, target_config, draft_vocab_size, has_vocab_map)
        if config.num_layers != 1:
            raise ValueError(f"EAGLE-3 drafts have one midlayer; config has num_hidden_layers={config.num_layers}")
        hidden = config.hidden_size
        if not own_embed and hidden != target_config.hidden_size:
            raise ValueError(f"EAGLE-3 draft hidden_size {hidden} differs from the target's "
                             f"{target_config.hidden_size}: the checkpoint must carry its own embed_tokens.weight")
        self._aux_layer_ids = tuple(aux_layer_ids)
        self.fc = nn.Linear(len(aux_layer_ids) * target_config.hidden_size, hidden, bias=fc_bias)
        self.embed_tokens = nn.Embedding(target_config.vocab_size, hidden) if own_embed else None
        self.midlayer = Eagle3MidLayer(config, norm_before_residual)
        self.norm = RMSNorm(hidden, config.rms_norm_eps)
        self.rotary = Rotary(config, max_positions or config.max_position_embeddings)
        own_head = own_head or self.draft_vocab_size != target_config.vocab_size
        self.lm_head = nn.Linear(hidden, self.draft_vocab_size, bias=False) if own_head else None

    @classmethod
    def from_published(cls, draft_json: dict[str, Any], keys: set[str] | None, target_config: ModelConfig,
                       max_positions: int | None = None) -> "Eagle3Draft":
        cfg = draft_layer_config(draft_json, target_config, int(draft_json.get("num_hidden_layers", 1)))
        cfg = replace(cfg, architecture="llama", qk_norm=False)
        target_hidden = int(draft_json.get("target_hidden_size") or target_config.hidden_size)
        if target_hidden != target_config.hidden_size:
            raise ValueError(f"EAGLE-3 config target_hidden_size {target_hidden} != target hidden_size "
                             f"{target_config.hidden_size}")
        own_embed = cfg.hidden_size != target_hidden and (keys is None or "embed_tokens.weight" in keys)
        return cls(cfg, target_config, aux_layer_ids=resolve_aux_layer_ids(draft_json, target_config.num_layers),
                   fc_bias=bool(draft_json.get("bias", False)), draft_vocab_size=draft_json.get("draft_vocab_size"),
                   has_vocab_map=keys is None or "d2t" in keys, own_head=keys is None or "lm_head.weight" in keys,
                   own_embed=own_embed, norm_before_residual=bool(draft_json.get("norm_before_residual", False)),
                   max_positions=max_positions)

    @property
    def aux_layer_ids(self) -> tuple[int, ...]:
        return self._aux_layer_ids

    def forward(self, input_ids, hidden, positions, backend, meta, step: int = 0, rows: OutputRows | None = None):
        width = self.config.hidden_size
        fused = hidden.shape[-1] != width
        if fused and hidden.shape[-1] != self.fc.in_features:
            raise ValueError(f"EAGLE-3 hidden has width {hidden.shape[-1]}: expected fused target "
                             f"features ({self.fc.in_features}) or a draft hidden ({width})")
        embeds = self.embed(input_ids)
        rope = self.rotary.table(positions, hidden.dtype)
        if self.cpu_stack is not None:  # the same kernels in one C call (specpd/spec/draft/eagle3_stack.py)
            out = self.cpu_stack.run(hidden, embeds, rope, backend, meta, rows)
            if out is not None:
                return out
        if fused:
            hidden = apply_linear(self.fc, hidden)  # [T, 3H] -> [T, H]
        return self.midlayer(embeds, hidden, rope, backend, meta, rows)

    def compute_logits(self, draft_hidden, step: int = 0):
        target = self._bound().model if self.lm_head is None else None
        return head_logits(self.norm(draft_hidden), self.lm_head, target)

    def _heads(self):
        return [(self, "lm_head")]

    def published_slots(self) -> dict[str, Slot]:
        slots = {"fc.weight": Slot("fc.weight")}
        if self.fc.bias is not None:
            slots["fc.bias"] = Slot("fc.bias")
        slots.update(decoder_layer_slots("midlayer.", "midlayer.", self.config))
        slots["midlayer.hidden_norm.weight"] = Slot("midlayer.hidden_norm.weight")
        slots["norm.weight"] = Slot("norm.weight")
        if self.lm_head is not None:
            slots["lm_head.weight"] = Slot("lm_head.weight")
        if self.embed_tokens is not None:
            slots["embed_tokens.weight"] = Slot("embed_tokens.weight")
        slots.update(self._vocab_map_slots())
        return slots

    def ignored_key(self, key: str) -> bool:
        return key == "embed_tokens.weight"  # a copy of the target's (same hidden size)

    def published_config(self) -> dict[str, Any]:
        out = hf_config_fields(self.config)
        out.update(architectures=["LlamaForCausalLMEagle3"], vocab_size=self.target_config.vocab_size,
                   draft_vocab_size=self.draft_vocab_size,
                   eagle_aux_hidden_state_layer_ids=list(self.aux_layer_ids),
                   eagle_config={"use_aux_hidden_state": True,
                                 "eagle_aux_hidden_state_layer_ids": [i - 1 for i in self.aux_layer_ids]})
        if self.fc.bias is not None:
            out["bias"] = True
        if self.config.hidden_size != self.target_config.hidden_size:
            out["target_hidden_size"] = self.target_config.hidden_size
        if self.midlayer.norm_before_residual:
            out["norm_before_residual"] = True
        return out
