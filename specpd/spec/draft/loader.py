"""Load, save and synthesise draft checkpoints in the published layouts.

A draft checkpoint is a directory (or a weights file with config.json beside it) holding
config.json and model.safetensors (sharded with model.safetensors.index.json, or pytorch_model.bin
as EAGLE-1 releases ship). Each family's module docstring lists its key layout; loading is strict
and names every missing or unexpected key.
"""
from __future__ import annotations

import importlib
import json
import os
from typing import TYPE_CHECKING, Any

import torch
from safetensors.torch import load_file, save_file

from specpd.config import ModelConfig
from specpd.spec.draft.base import DraftModel, hf_config_fields

if TYPE_CHECKING:
    from specpd.model.llama import CausalLM

_FAMILIES = {
    "eagle": "specpd.spec.draft.eagle:Eagle1Draft",
    "eagle3": "specpd.spec.draft.eagle3:Eagle3Draft",
    "mtp": "specpd.spec.draft.mtp:MTPDraft",
}
_ALIASES = {"eagle1": "eagle", "nextn": "mtp"}


def draft_class(algorithm: str) -> type[DraftModel]:
    name = _ALIASES.get(algorithm.lower(), algorithm.lower())
    if name not in _FAMILIES:
        raise ValueError(f"unknown draft algorithm {algorithm!r}; choose from {sorted(_FAMILIES)} "
                         f"(aliases {sorted(_ALIASES)})")
    module, cls = _FAMILIES[name].split(":")
    return getattr(importlib.import_module(module), cls)


HEADS_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "heads")  # drafts shipped in the package
DEFAULT_HEAD_PREFIX = "smollm2-135m-instruct-"  # + family: the heads trained for `--model default`


def shipped_heads() -> list[str]:
    """Families with a head for the default model under specpd/spec/draft/heads/."""
    if not os.path.isdir(HEADS_DIR):
        return []
    return sorted(n.removeprefix(DEFAULT_HEAD_PREFIX) for n in os.listdir(HEADS_DIR)
                  if n.startswith(DEFAULT_HEAD_PREFIX) and os.path.isfile(os.path.join(HEADS_DIR, n, "config.json")))


def resolve_draft_path(name: str | None, algorithm: str) -> str | None:
    """`--draft-model default` -> the head shipped for the default model and this family; others as given."""
    if name != "default":
        return name
    family = draft_class(algorithm).algorithm
    path = os.path.join(HEADS_DIR, DEFAULT_HEAD_PREFIX + family)
    if not os.path.isfile(os.path.join(path, "config.json")):
        raise ValueError(f"--draft-model default: specpd ships no {family} head for the default model "
                         f"(shipped: {shipped_heads() or 'none'}); train one with `specpd train-draft`")
    return path


def read_draft_config(path: str) -> dict[str, Any]:
    """config.json of a draft checkpoint (a directory or a weights file beside its config.json)."""
    directory = path if os.path.isdir(path) else os.path.dirname(path) or "."
    config_file = os.path.join(directory, "config.json")
    if not os.path.isfile(config_file):
        raise FileNotFoundError(f"no config.json for draft checkpoint {path!r}")
    with open(config_file, encoding="utf-8") as f:
        return json.load(f)


def draft_feature_layers(path: str, algorithm: str, num_target_layers: int) -> tuple[int, ...]:
    """Target layers whose inputs the draft consumes (EAGLE-3's fused aux layers); () = the final hidden.

    What a prefill server captures for draft-on-decode-only without loading the draft itself."""
    if draft_class(algorithm).algorithm != "eagle3":
        return ()
    from specpd.spec.draft.eagle3 import resolve_aux_layer_ids
    return resolve_aux_layer_ids(read_draft_config(resolve_draft_path(path, algorithm)), num_target_layers)


def draft_kv_geometry(path: str, algorithm: str, target_config: ModelConfig) -> tuple[int, int, int]:
    """(KV layers, kv heads, head dim) of a draft checkpoint, from its config alone (built on the meta device)."""
    config = read_draft_config(resolve_draft_path(path, algorithm))
    with torch.device("meta"):
        model = draft_class(algorithm).from_published(config, None, target_config)
    c = model.config
    return c.num_layers, c.num_kv_heads, c.head_dim


def shared_page_layers(spec, target_config: ModelConfig) -> int:
    """Draft layers to keep in the target's KV pages (0: the draft gets its own pool): all of them when
    their KV heads and head dim equal the target's, so one descriptor per page moves both
    (docs/architecture.md, "KV cache", draft layers)."""
    if spec.enabled and spec.speculative_algorithm == "mtp" and not spec.draft_model:
        return target_config.num_nextn_predict_layers  # the checkpoint's own MTP layers: the target's geometry
    if not spec.enabled or spec.speculative_algorithm == "replay" or not spec.draft_model:
        return 0
    layers, kv_heads, head_dim = draft_kv_geometry(spec.draft_model, spec.speculative_algorithm, target_config)
    return layers if (kv_heads, head_dim) == (target_config.num_kv_heads, target_config.head_dim) else 0


def read_draft_checkpoint(path: str) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """-> (config.json dict, {published key: tensor}) from a directory or a weights file."""
    config = read_draft_config(path)
    if not os.path.isdir(path):
        files = [path]
    elif os.path.isfile(index := os.path.join(path, "model.safetensors.index.json")):
        with open(index, encoding="utf-8") as f:
            files = [os.path.join(path, n) for n in sorted(set(json.load(f)["weight_map"].values()))]
    else:
        files = sorted(os.path.join(path, n) for n in os.listdir(path) if n.endswith(".safetensors"))
        if not files and os.path.isfile(bin_file := os.path.join(path, "pytorch_model.bin")):
            files = [bin_file]
    if not files:
        raise FileNotFoundError(f"no model.safetensors or pytorch_model.bin in draft checkpoint {path!r}")
    weights: dict[str, torch.Tensor] = {}
    for file in files:
        if file.endswith(".safetensors"):
            weights.update(load_file(file))
        else:
            weights.update(torch.load(file, map_location="cpu", weights_only=True))
    return config, weights


def load_draft_model(path_or_dir: str, algorithm: str, target: "CausalLM", target_config: ModelConfig,
                     dtype: torch.dtype = torch.float32, hot_token_ids: torch.Tensor | None = None,
                     max_positions: int | None = None) -> DraftModel:
    """Build the draft for `target`, load its published checkpoint, bind the target's shared weights.

    hot_token_ids (target ids) restricts the draft head to those rows (DraftModel.restrict_vocab);
    max_positions: its rotary table's length (default: the target's).
    """
    path_or_dir = resolve_draft_path(path_or_dir, algorithm)
    config, weights = read_draft_checkpoint(path_or_dir)
    vocab = config.get("vocab_size", target_config.vocab_size)
    if vocab != target_config.vocab_size:
        raise ValueError(f"draft {path_or_dir!r} has vocab_size {vocab}, target has {target_config.vocab_size}")
    device = target.embed_tokens.weight.device
    max_positions = max_positions or target.rotary.cos.shape[0]
    model = draft_class(algorithm).from_published(config, set(weights), target_config, max_positions)
    model.to(device=device, dtype=dtype)
    model.load_published(weights, source=f"checkpoint {path_or_dir!r}")
    model.bind_target(target)
    if hot_token_ids is not None:
        model.restrict_vocab(hot_token_ids)
    return model.eval()


def save_draft_model(model: DraftModel, directory: str) -> None:
    """config.json + model.safetensors in the family's published layout."""
    os.makedirs(directory, exist_ok=True)
    with open(os.path.join(directory, "config.json"), "w", encoding="utf-8") as f:
        json.dump(model.published_config(), f, indent=2)
    state = {k: v.cpu().contiguous() for k, v in model.published_state().items()}
    save_file(state, os.path.join(directory, "model.safetensors"), metadata={"format": "pt"})


@torch.no_grad()
def random_draft_checkpoint(directory: str, algorithm: str, target_config: ModelConfig, seed: int = 0,
                            draft_vocab_size: int | None = None, **config_overrides: Any) -> dict[str, Any]:
    """Write a random draft for a target with `target_config` in the published layout (for tests).

    config_overrides go into config.json (e.g. eagle_aux_hidden_state_layer_ids,
    num_nextn_predict_layers, bias). Returns the written config.
    """
    cls = draft_class(algorithm)
    config = hf_config_fields(target_config)
    if cls.algorithm == "mtp":
        config["num_nextn_predict_layers"] = 1
    else:
        config["num_hidden_layers"] = 1
    if draft_vocab_size is not None:
        config["draft_vocab_size"] = draft_vocab_size
    config.update(config_overrides)
    model = cls.from_published(config, None, target_config)
    gen = torch.Generator().manual_seed(seed)
    for name, p in model.named_parameters():
        if name.endswith("norm.weight"):
            p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=gen))
        elif p.dim() == 1:  # biases
            p.normal_(0.0, 0.1, generator=gen)
        else:
            p.normal_(0.0, 0.25 if "head" in name or "embed" in name else 0.08, generator=gen)
    if model.d2t is not None and model.draft_vocab_size != target_config.vocab_size:
        hot = torch.randperm(target_config.vocab_size, generator=gen)[:model.draft_vocab_size].sort().values
        model.d2t.copy_(hot - torch.arange(hot.numel()))
        model.t2d.zero_()
        model.t2d[hot] = True
    save_draft_model(model, directory)
    return model.published_config()
