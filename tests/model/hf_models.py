"""Tiny random HF models built in code (no downloads), saved as HF directories for specpd to load."""
from __future__ import annotations

import torch

TINY = dict(vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
            bos_token_id=None, eos_token_id=None, pad_token_id=None)


def tiny_config(arch: str, **overrides):
    from transformers import LlamaConfig, Qwen2Config, Qwen3Config
    kw = dict(TINY)
    if arch == "llama":
        kw.update(rope_theta=10000.0)
        cfg_cls = LlamaConfig
    elif arch == "llama3":  # llama-3 rope scaling, untied head, MHA
        kw.update(num_key_value_heads=4, rope_theta=500000.0, tie_word_embeddings=False,
                  rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0,
                                    high_freq_factor=4.0, original_max_position_embeddings=64))
        cfg_cls = LlamaConfig
    elif arch == "qwen2":
        kw.update(rope_theta=1000000.0, tie_word_embeddings=True)
        cfg_cls = Qwen2Config
    elif arch == "qwen3":
        kw.update(head_dim=32, rope_theta=1000000.0, tie_word_embeddings=False)
        cfg_cls = Qwen3Config
    else:
        raise ValueError(arch)
    kw.update(overrides)
    return cfg_cls(**kw)


def save_tiny_model(arch: str, path, seed: int = 0, **overrides):
    """Build a random model, scale its weights so that greedy outputs are not degenerate, save it."""
    from transformers import AutoModelForCausalLM
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_config(arch, **overrides), dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() > 1:
                p.normal_(0, 0.25 if "embed" in name or "lm_head" in name else 0.08)
            elif "bias" in name:
                p.normal_(0, 0.1)
    model.eval()
    model.save_pretrained(path, safe_serialization=True)
    return model
