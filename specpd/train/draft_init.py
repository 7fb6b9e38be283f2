"""A fresh draft to train: the draft vocabulary and the initial weights.

Draft vocabulary (--draft-vocab-size V): the V target tokens most often seen as training targets
(loss_mask 1) in the feature cache, ties to the lower id, as EAGLE-3 / SpecForge choose theirs. The
head keeps those rows of the target's LM head as its starting point; d2t / t2d are the published
maps (target_id = draft_id + d2t[draft_id]).

Weights: decoder layers and fc / eh_proj take torch's default init under the run's seed, norms
start at 1, a draft's own head starts as (rows of) the target's head. (Starting the final norm
as the target's final norm was tried: sharper random logits at first, and a higher loss after 50
steps of a 40k-token SmolLM2 run; it is not used.) The embedding (and, for a
full-vocab EAGLE-1 / MTP draft, the head) is the target's, bound by reference and frozen.
"""
from __future__ import annotations

from typing import Any

import torch
from torch import nn

from specpd.config import ModelConfig
from specpd.spec.draft.base import DraftModel, hf_config_fields
from specpd.spec.draft.loader import draft_class, load_draft_model
from specpd.model.llama import RMSNorm


def select_draft_vocab(counts: torch.Tensor, size: int) -> torch.Tensor:
    """counts [vocab] -> the `size` most frequent ids (ties: lower id first), sorted ascending."""
    if not 0 < size <= counts.numel():
        raise ValueError(f"--draft-vocab-size must be in [1, {counts.numel()}] (the target vocab), got {size}")
    order = torch.argsort(-counts, stable=True)
    return order[:size].sort().values


def draft_json(algorithm: str, target_config: ModelConfig, draft_vocab_size: int | None = None,
               num_layers: int = 1, **overrides: Any) -> dict[str, Any]:
    """config.json of a draft shaped like the target's layers (the published layouts' convention)."""
    cls = draft_class(algorithm)
    config = hf_config_fields(target_config)
    if cls.algorithm == "mtp":
        config["num_nextn_predict_layers"] = num_layers
    else:
        config["num_hidden_layers"] = num_layers
    if draft_vocab_size is not None and draft_vocab_size != target_config.vocab_size:
        config["draft_vocab_size"] = draft_vocab_size
    config.update(overrides)
    return config


def new_draft(algorithm: str, target, target_config: ModelConfig, hot_token_ids: torch.Tensor | None = None,
              num_layers: int = 1, seed: int = 0, max_positions: int | None = None,
              **overrides: Any) -> DraftModel:
    """An fp32 draft bound to `target` (a CausalLM), ready to train. hot_token_ids: the draft vocab
    (sorted target ids) or None for the full target vocab."""
    vocab = target_config.vocab_size
    size = None if hot_token_ids is None else int(hot_token_ids.numel())
    config = draft_json(algorithm, target_config, size, num_layers, **overrides)
    torch.manual_seed(seed)
    model = draft_class(algorithm).from_published(config, None, target_config, max_positions)
    model = model.float()
    model.bind_target(target)
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, RMSNorm):
                module.weight.fill_(1.0)
        head = target.lm_head_weight.detach().float()  # [vocab, H]
        if model.d2t is not None:
            hot = hot_token_ids if hot_token_ids is not None else torch.arange(vocab)
            model.d2t.copy_(hot - torch.arange(hot.numel()))
            model.t2d.zero_()
            model.t2d[hot] = True
            rows = hot
        else:
            rows = torch.arange(vocab)
        for owner, attr in model._heads():
            own: nn.Linear | None = getattr(owner, attr)
            if own is not None and own.weight.shape[1] == head.shape[1]:
                own.weight.copy_(head[rows])
        if model.embed_tokens is not None and model.embed_tokens.weight.shape[1] == head.shape[1]:
            model.embed_tokens.weight.copy_(target.embed_tokens.weight.float())
    model.check_vocab_map()
    return model


def init_draft(path: str, algorithm: str, target, target_config: ModelConfig, max_positions: int | None = None
               ) -> tuple[DraftModel, torch.Tensor | None]:
    """A trained draft to go on training (--init-draft): its weights in fp32, bound to `target`, and
    its draft vocab (sorted target ids, None for the full vocab), which the run keeps."""
    model = load_draft_model(path, algorithm, target, target_config, torch.float32, max_positions=max_positions)
    model.check_vocab_map()
    hot = None if model.d2t is None else model.draft_to_target(torch.arange(model.draft_vocab_size))
    return model, hot
