"""Draft model interface shared by the EAGLE-1, EAGLE-3 and MTP families.

How a draft is driven (the proposer owns this loop; the draft model is a pure function of its inputs
plus its own paged KV):
  1. The target runs a forward and hands over features for each position p: EAGLE-1 / MTP take the
     target's normed final hidden [T, H]; EAGLE-3 takes the concatenation of the target's layer INPUT
     hiddens at `aux_layer_ids`, in ascending layer order (exactly what `CausalLM.forward(...,
     capture_layers=draft.aux_layer_ids)` returns, concatenated on the last dim) [T, 3H].
  2. The draft row at position p pairs the token x_{p+1} with the feature of position p (inputs are
     shifted left by one, positions are not), and writes its KV at position p in its own KVPool.
  3. Later draft steps feed back the draft's own output hidden [T, H] (pre-norm, as EAGLE-1/-3 and
     vLLM's MTP do); `compute_logits` applies the family's final norm (if any) and head.

Draft vocabulary: when the draft head covers only `draft_vocab_size` < target vocab rows, logits are
over draft ids and `draft_to_target` maps them with the published d2t table
(target_id = draft_id + d2t[draft_id]); t2d[target_id] says whether a target id is in the draft vocab.

Checkpoints: every family describes its published key layout as {published key: Slot}; loading,
saving and the missing/unexpected key errors are generic (`load_published`, `published_state`).
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from specpd.attention.base import AttentionBackend
from specpd.attention.metadata import AttentionMetadata
from specpd.config import ModelConfig

if TYPE_CHECKING:
    from specpd.model.llama import CausalLM, OutputRows


@dataclass(frozen=True)
class Slot:
    """Where one published tensor lives in the draft: a parameter/buffer name, and for the fused
    qkv_proj / gate_up_proj tensors the row range [start, end) the published piece occupies."""

    name: str
    rows: tuple[int, int] | None = None


class TargetBinding:
    """The target's embedding and LM head, borrowed by reference.

    Deliberately not an nn.Module attribute of the draft: borrowed weights are not saved with the
    draft, not cast by `draft.to(...)`, and not trained by a draft trainer.
    """

    def __init__(self, target: "CausalLM"):
        self.model = target

    def embed(self, token_ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed_tokens(token_ids)

    @property
    def head_weight(self) -> torch.Tensor:
        return self.model.lm_head_weight  # [vocab, H]


class DraftModel(nn.Module, ABC):
    algorithm: ClassVar[str] = ""
    uses_target_final_hidden: ClassVar[bool] = True
    # a forward in one C call where the draft has one (EAGLE-3: specpd/spec/draft/eagle3_stack.py), set by its
    # proposer once the linears are packed; None: the Python path
    cpu_stack = None

    def __init__(self, config: ModelConfig, target_config: ModelConfig, draft_vocab_size: int | None,
                 has_vocab_map: bool):
        super().__init__()
        # The draft's attention layers: config.num_layers == num_kv_layers, so
        # KVPool.for_model(draft.config, ...) builds the draft pool and its backend takes
        # (config.num_heads, config.head_dim).
        self.config = config
        self.target_config = target_config
        self.draft_vocab_size = draft_vocab_size or target_config.vocab_size
        reduced = self.draft_vocab_size != target_config.vocab_size
        if reduced and self.draft_vocab_size > target_config.vocab_size:
            raise ValueError(f"draft_vocab_size {self.draft_vocab_size} exceeds the target vocab "
                             f"size {target_config.vocab_size}")
        with_map = reduced or has_vocab_map
        self.register_buffer("d2t", torch.zeros(self.draft_vocab_size, dtype=torch.long) if with_map else None)
        self.register_buffer("t2d", torch.ones(target_config.vocab_size, dtype=torch.bool) if with_map else None)
        self.target: TargetBinding | None = None
        self.embed_tokens: nn.Embedding | None = None  # own embedding; None = the target's

    @classmethod
    @abstractmethod
    def from_published(cls, draft_json: dict[str, Any], keys: set[str] | None, target_config: ModelConfig,
                       max_positions: int | None = None) -> "DraftModel":
        """Build (uninitialised) from config.json and the checkpoint's key set, which decides the
        layout's optional parts (own head, vocab map, bias). keys=None: the canonical published
        layout, for writing fresh checkpoints."""

    # ---- the interface the proposer uses -------------------------------------------------------

    @abstractmethod
    def forward(self, input_ids: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor,
                backend: AttentionBackend, meta: AttentionMetadata, step: int = 0,
                rows: OutputRows | None = None) -> torch.Tensor:
        """input_ids [T] target-vocab ids, hidden [T, Hin] target features or the previous draft
        hidden, positions [T] -> draft hidden [T, H] (pre final norm); with `rows`, [R, H] at rows.index
        only (the draft's K/V is written at every row)."""

    @abstractmethod
    def compute_logits(self, draft_hidden: torch.Tensor, step: int = 0) -> torch.Tensor:
        """draft hidden [T, H] -> logits over the draft vocab [T, draft_vocab_size], fp32. `step`
        picks the MTP module whose shared_head.norm applies; EAGLE ignores it."""

    @property
    def num_kv_layers(self) -> int:
        return self.config.num_layers

    @property
    def aux_layer_ids(self) -> tuple[int, ...]:
        """Target layers whose INPUT hidden the draft fuses (EAGLE-3 only), ascending."""
        return ()

    def draft_to_target(self, ids: torch.Tensor) -> torch.Tensor:
        """Draft-vocab ids (any shape) -> target-vocab ids."""
        return ids if self.d2t is None else ids + self.d2t[ids]

    def to_target_vocab(self, values: torch.Tensor, fill: float = 0.0) -> torch.Tensor:
        """[T, draft_vocab] (probs or logits) -> [T, vocab] with `fill` at target ids the draft
        vocab lacks; what rejection sampling needs to compare q with the target's p."""
        if self.d2t is None:
            return values
        out = values.new_full((values.shape[0], self.target_config.vocab_size), fill)
        out[:, self.draft_to_target(torch.arange(self.draft_vocab_size, device=values.device))] = values
        return out

    # ---- shared weights ------------------------------------------------------------------------

    def bind_target(self, target: "CausalLM") -> None:
        self.target = TargetBinding(target)

    def _bound(self) -> TargetBinding:
        if self.target is None:
            raise RuntimeError(f"{self.algorithm} draft shares weights with the target: call bind_target(target) first")
        return self.target

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.embed_tokens is not None:
            return self.embed_tokens(input_ids)
        return self._bound().embed(input_ids)

    def _logits(self, x: torch.Tensor, head: nn.Linear | None) -> torch.Tensor:
        weight = head.weight if head is not None else self._bound().head_weight
        return F.linear(x, weight).float()

    # ---- reduced draft vocabulary --------------------------------------------------------------

    @abstractmethod
    def _heads(self) -> list[tuple[nn.Module, str]]:
        """(owner module, attribute) of every LM head slot; the attribute holds nn.Linear or None
        (None = the target's head)."""

    @torch.no_grad()
    def restrict_vocab(self, hot_token_ids: torch.Tensor) -> None:
        """Keep only `hot_token_ids` (target ids) in the draft head: own head rows + d2t/t2d.

        The LM head over a 49k vocab is a large share of a draft step on CPU; EAGLE-3 checkpoints
        ship this natively, this builds it for any family from a full-vocab head.
        """
        if self.draft_vocab_size != self.target_config.vocab_size:
            raise ValueError(f"{self.algorithm} draft already has a reduced vocab ({self.draft_vocab_size} ids)")
        hot = torch.unique(hot_token_ids.long().flatten().cpu())  # sorted
        vocab = self.target_config.vocab_size
        if hot.numel() == 0 or hot[0] < 0 or hot[-1] >= vocab:
            raise ValueError(f"hot_token_ids must be non-empty target ids in [0, {vocab})")
        for owner, attr in self._heads():
            head = getattr(owner, attr)
            full = head.weight if head is not None else self._bound().head_weight
            reduced = nn.Linear(full.shape[1], hot.numel(), bias=False, dtype=full.dtype, device=full.device)
            reduced.weight.copy_(full[hot.to(full.device)])
            setattr(owner, attr, reduced)
        device = self.t2d.device if self.t2d is not None else next(self.parameters()).device
        self.draft_vocab_size = hot.numel()
        self.d2t = (hot - torch.arange(hot.numel())).to(device)
        t2d = torch.zeros(vocab, dtype=torch.bool)
        t2d[hot] = True
        self.t2d = t2d.to(device)

    def check_vocab_map(self) -> None:
        if self.d2t is None:
            return
        ids = self.draft_to_target(torch.arange(self.draft_vocab_size, device=self.d2t.device))
        vocab = self.target_config.vocab_size
        if ids.min() < 0 or ids.max() >= vocab or ids.unique().numel() != ids.numel():
            raise ValueError(f"d2t maps draft ids outside [0, {vocab}) or onto the same target id twice")
        if not bool(self.t2d[ids].all()) or int(self.t2d.sum()) != self.draft_vocab_size:
            raise ValueError("t2d disagrees with d2t: t2d must be True exactly at the target ids d2t maps to")

    # ---- published checkpoint layout -----------------------------------------------------------

    @abstractmethod
    def published_slots(self) -> dict[str, Slot]:
        """{published checkpoint key: where it lives in this model}."""

    def ignored_key(self, key: str) -> bool:
        """Published keys accepted and skipped (e.g. frozen copies of the target's embedding)."""
        return False

    @abstractmethod
    def published_config(self) -> dict[str, Any]:
        """config.json contents in the published layout."""

    def _tensor(self, name: str) -> torch.Tensor:
        try:
            return self.get_parameter(name)
        except AttributeError:
            return self.get_buffer(name)

    def published_state(self) -> dict[str, torch.Tensor]:
        state = {}
        for key, slot in self.published_slots().items():
            t = self._tensor(slot.name)
            state[key] = (t if slot.rows is None else t[slot.rows[0]:slot.rows[1]]).detach().clone()
        return state

    @torch.no_grad()
    def load_published(self, weights: dict[str, torch.Tensor], source: str = "checkpoint") -> None:
        """Strict load: every published key of this layout must be present and nothing else."""
        slots = self.published_slots()
        unexpected = sorted(k for k in weights if k not in slots and not self.ignored_key(k))
        missing = sorted(k for k in slots if k not in weights)
        if unexpected or missing:
            parts = []
            if unexpected:
                parts.append(f"unexpected keys {_head_of(unexpected)}")
            if missing:
                parts.append(f"missing keys {_head_of(missing)}")
            raise ValueError(f"{self.algorithm} draft {source}: " + "; ".join(parts)
                             + f" (expected the published layout: {_head_of(sorted(slots), 6)})")
        for key, slot in slots.items():
            t = self._tensor(slot.name)
            dst = t if slot.rows is None else t[slot.rows[0]:slot.rows[1]]
            src = weights[key]
            if tuple(dst.shape) != tuple(src.shape):
                raise ValueError(f"{self.algorithm} draft {source}: {key} has shape {tuple(src.shape)}, "
                                 f"expected {tuple(dst.shape)}")
            dst.copy_(src)
        self.check_vocab_map()

    def _vocab_map_slots(self) -> dict[str, Slot]:
        return {} if self.d2t is None else {"d2t": Slot("d2t"), "t2d": Slot("t2d")}


def _head_of(keys: list[str], n: int = 8) -> str:
    return str(keys[:n])[:-1] + (f", ... {len(keys) - n} more]" if len(keys) > n else "]")


def decoder_layer_slots(pub: str, mod: str, cfg: ModelConfig, input_layernorm: bool = True) -> dict[str, Slot]:
    """Published HF names of one decoder layer (q/k/v, gate/up split) -> specpd's fused layout.

    pub: published prefix ("layers.0."), mod: module path in the draft ("layers.0.").
    """
    q, kv, inter = cfg.q_size, cfg.kv_size, cfg.intermediate_size
    qkv = {"q": (0, q), "k": (q, q + kv), "v": (q + kv, q + 2 * kv)}
    slots = {f"{pub}self_attn.{p}_proj.weight": Slot(f"{mod}self_attn.qkv_proj.weight", rows)
             for p, rows in qkv.items()}
    if cfg.attention_bias:
        slots.update({f"{pub}self_attn.{p}_proj.bias": Slot(f"{mod}self_attn.qkv_proj.bias", rows)
                      for p, rows in qkv.items()})
    if cfg.qk_norm:
        for p in ("q", "k"):
            slots[f"{pub}self_attn.{p}_norm.weight"] = Slot(f"{mod}self_attn.{p}_norm.weight")
    slots[f"{pub}self_attn.o_proj.weight"] = Slot(f"{mod}self_attn.o_proj.weight")
    slots[f"{pub}mlp.gate_proj.weight"] = Slot(f"{mod}mlp.gate_up_proj.weight", (0, inter))
    slots[f"{pub}mlp.up_proj.weight"] = Slot(f"{mod}mlp.gate_up_proj.weight", (inter, 2 * inter))
    slots[f"{pub}mlp.down_proj.weight"] = Slot(f"{mod}mlp.down_proj.weight")
    if input_layernorm:
        slots[f"{pub}input_layernorm.weight"] = Slot(f"{mod}input_layernorm.weight")
    slots[f"{pub}post_attention_layernorm.weight"] = Slot(f"{mod}post_attention_layernorm.weight")
    return slots


_HF_ARCH = {"llama": ("llama", "LlamaForCausalLM"), "qwen2": ("qwen2", "Qwen2ForCausalLM"),
            "qwen3": ("qwen3", "Qwen3ForCausalLM")}


def hf_config_fields(cfg: ModelConfig) -> dict[str, Any]:
    """The config.json fields of a ModelConfig (inverse of ModelConfig.from_hf for what it reads)."""
    model_type, arch = _HF_ARCH[cfg.architecture]
    return {
        "architectures": [arch], "model_type": model_type, "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size, "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.num_layers, "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_kv_heads, "head_dim": cfg.head_dim, "hidden_act": "silu",
        "rms_norm_eps": cfg.rms_norm_eps, "rope_theta": cfg.rope_theta,
        "rope_scaling": cfg.rope_scaling_dict, "max_position_embeddings": cfg.max_position_embeddings,
        "attention_bias": cfg.attention_bias, "tie_word_embeddings": False,
    }


def draft_layer_config(draft_json: dict[str, Any], target_config: ModelConfig, num_layers: int) -> ModelConfig:
    """ModelConfig of the draft's decoder layers from its config.json.

    A config without the layer fields (an MTP config that only says num_nextn_predict_layers) takes
    them from the target. `qkv_bias` (EAGLE's name for Qwen2-style q/k/v bias) maps to attention_bias.
    """
    from specpd.model.loader import normalize_hf_config

    cfg = dict(draft_json)
    if "hidden_size" not in cfg:
        cfg = {**hf_config_fields(target_config), **cfg}
    if "qkv_bias" in cfg:
        cfg["attention_bias"] = bool(cfg["qkv_bias"])
    cfg.setdefault("model_type", "llama")
    return replace(ModelConfig.from_hf(normalize_hf_config(cfg)), num_layers=num_layers)
