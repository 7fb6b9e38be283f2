"""MTP as the models ship it: `--speculative-algorithm mtp` with no `--draft-model` drafts with the target checkpoint's
own NextN layers (DeepSeek-V3 / R1: model.layers.61; GLM-4.5: model.layers.92, GLM-4.5-Air: .46; the first
index is num_hidden_layers, num_nextn_predict_layers of them), in MTPDraft's published layout (specpd/spec/draft/mtp.py):
enorm, hnorm, eh_proj, a decoder block of the target's family, shared_head.norm and shared_head.head (the
module's own head where the checkpoint has one, else the target's lm_head), sharing the target's embedding.

Only those layers' tensors are read (safetensors opened lazily, the shards that hold them found through
model.safetensors.index.json), FP8 blocks dequantized as the target's. Their KV: one layer per MTP module inside
the target's pages (the runner reserves them: draft/loader.shared_page_layers), latent rows for MLA, so a PD
handoff moves them in the same page descriptors as the target's.
"""
from __future__ import annotations

import json
import os
import re
from typing import TYPE_CHECKING

import torch
from safetensors import safe_open

from specpd.config import ModelConfig
from specpd.spec.draft.mtp import MTPDraft
from specpd.model.default import resolve_model_path
from specpd.model.fp8 import dequantize_fp8
from specpd.model.loader import normalize_hf_config

if TYPE_CHECKING:
    from specpd.model.llama import CausalLM

_LAYER = re.compile(r"model\.layers\.(\d+)\.")


def checkpoint_mtp_weights(path: str, first: int, count: int) -> dict[str, torch.Tensor]:
    """{key: fp32 tensor} of model.layers.{first .. first + count - 1}.* in the safetensors of directory `path`."""
    index = os.path.join(path, "model.safetensors.index.json")
    wanted = range(first, first + count)

    def is_mtp(key: str) -> bool:
        m = _LAYER.match(key)
        return m is not None and int(m.group(1)) in wanted

    if os.path.isfile(index):
        with open(index, encoding="utf-8") as f:
            shards = sorted({file for key, file in json.load(f)["weight_map"].items() if is_mtp(key)})
    else:
        shards = sorted(n for n in os.listdir(path) if n.endswith(".safetensors"))
    out = {}
    for shard in shards:
        with safe_open(os.path.join(path, shard), "pt") as f:
            for key in f.keys():
                if is_mtp(key):
                    t = f.get_tensor(key)
                    out[key] = t.float() if t.is_floating_point() else t
    return out


def load_checkpoint_mtp(model_path: str, target: "CausalLM", target_config: ModelConfig,
                        dtype: torch.dtype = torch.float32) -> MTPDraft:
    """The target checkpoint's MTP layers as an MTPDraft bound to `target` (ValueError when it ships none)."""
    path = resolve_model_path(model_path)
    count = target_config.num_nextn_predict_layers
    if not os.path.isdir(path) or count == 0:
        raise ValueError(f"--speculative-algorithm mtp without --draft-model drafts with the checkpoint's own MTP "
                         f"layers, and {model_path!r} has none (num_nextn_predict_layers = {count}): pass "
                         f"--draft-model DIR")
    with open(os.path.join(path, "config.json"), encoding="utf-8") as f:
        config = normalize_hf_config(json.load(f))
    first = target_config.num_layers
    weights = dequantize_fp8(checkpoint_mtp_weights(path, first, count))
    if not weights:
        raise ValueError(f"{path!r}: config.json says num_nextn_predict_layers = {count}, but its safetensors hold no "
                         f"model.layers.{first}.* (a checkpoint whose MTP weights were dropped, e.g. re-saved by "
                         f"transformers): pass --draft-model DIR")
    device = target.embed_tokens.weight.device
    model = MTPDraft.from_published(config, set(weights), target_config, target.rotary.cos.shape[0])
    model.to(device=device, dtype=dtype)
    model.load_published(weights, source=f"the MTP layers of checkpoint {path!r}")
    model.bind_target(target)
    return model.eval()
