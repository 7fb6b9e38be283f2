"""Checkpoint loading: one entry point for HF directories and GGUF files.

`load_checkpoint(path)` returns HF parameter names and an HF config.json-style
dict whatever the source, so model code only knows one layout:
  - "default"           -> the SmolLM2-135M-Instruct GGUF (specpd.model.default)
  - a directory         -> config.json + *.safetensors (sharded or not) + tokenizer files
  - a *.gguf file       -> specpd.model.gguf_loader (its converted copy after the first load: gguf_cache)
"""
from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass, field
from typing import Any

import torch
from safetensors.torch import load_file

from specpd.model.default import resolve_model_path
from specpd.model.quant import QuantBlocks
from specpd.model.tokenizer import Tokenizer

logger = logging.getLogger(__name__)


@dataclass
class Checkpoint:
    hf_config: dict[str, Any]          # config.json form, rope_theta/rope_scaling at top level
    weights: dict[str, torch.Tensor]   # HF names, e.g. model.layers.0.self_attn.q_proj.weight
    tokenizer: Tokenizer | None        # None when the source carries no tokenizer
    name: str                          # the resolved path
    # a GGUF's quantized matrices as the file holds them (HF names; specpd.model.quant serves them); {} elsewhere
    blocks: dict[str, QuantBlocks] = field(default_factory=dict)


def load_checkpoint(path: str, dtype: torch.dtype = torch.float32) -> Checkpoint:
    resolved = resolve_model_path(path)
    blocks: dict[str, QuantBlocks] = {}
    if os.path.isdir(resolved):
        config, weights, tokenizer = _load_hf_dir(resolved, dtype)
    elif resolved.endswith(".gguf"):
        from specpd.model.gguf_cache import load_gguf_cached
        config, weights, tokenizer, blocks = load_gguf_cached(resolved, dtype)
    else:
        raise ValueError(f"cannot load {resolved!r}: expected a model directory or a .gguf file")
    if config.get("tie_word_embeddings"):
        weights.pop("lm_head.weight", None)
        blocks.pop("lm_head.weight", None)
    return Checkpoint(hf_config=config, weights=weights, tokenizer=tokenizer, name=resolved, blocks=blocks)


def normalize_hf_config(config: dict[str, Any]) -> dict[str, Any]:
    """Fill the fields model code relies on, whichever transformers wrote the file.

    transformers >= 5 nests rope_theta and the scaling type in `rope_parameters`;
    older files have top-level rope_theta / rope_scaling. We expose both.
    """
    config = dict(config)
    rope = config.get("rope_parameters") or {}
    if "rope_theta" not in config:
        config["rope_theta"] = float(rope.get("rope_theta", 10000.0))
    if "rope_scaling" not in config:
        scaling = {k: v for k, v in rope.items() if k != "rope_theta"}
        config["rope_scaling"] = scaling if scaling.get("rope_type", "default") != "default" else None
    config.setdefault("num_key_value_heads", config["num_attention_heads"])
    if config.get("head_dim") is None:
        config["head_dim"] = config["hidden_size"] // config["num_attention_heads"]
    config.setdefault("tie_word_embeddings", False)
    config.setdefault("rms_norm_eps", 1e-6)
    config.setdefault("attention_bias", config.get("model_type") == "qwen2")
    return config


def _load_hf_dir(path: str, dtype: torch.dtype
                 ) -> tuple[dict[str, Any], dict[str, torch.Tensor], Tokenizer | None]:
    config_file = os.path.join(path, "config.json")
    if not os.path.isfile(config_file):
        raise FileNotFoundError(f"no config.json in model directory {path!r}")
    with open(config_file, encoding="utf-8") as f:
        config = normalize_hf_config(json.load(f))

    index_file = os.path.join(path, "model.safetensors.index.json")
    if os.path.isfile(index_file):
        with open(index_file, encoding="utf-8") as f:
            shard_names = sorted(set(json.load(f)["weight_map"].values()))
    else:
        shard_names = sorted(n for n in os.listdir(path) if n.endswith(".safetensors"))
    if not shard_names:
        raise FileNotFoundError(f"no *.safetensors weights in model directory {path!r}")

    weights: dict[str, torch.Tensor] = {}
    for shard in shard_names:
        for name, tensor in load_file(os.path.join(path, shard)).items():
            weights[name] = tensor.to(dtype) if tensor.is_floating_point() else tensor

    try:
        tokenizer = Tokenizer.from_hf_dir(path)
    except FileNotFoundError as exc:
        logger.info("%s", exc)
        tokenizer = None
    return config, weights, tokenizer
