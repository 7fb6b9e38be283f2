"""A DeepSeek-V3-shaped checkpoint with its own MTP layer, random, for evals/pd_mtp.py: transformers'
DeepseekV3ForCausalLM from a config (MLA, routed + shared experts with group-limited routing, a dense first layer,
YaRN), saved in bf16 with one NextN layer appended in DeepSeek's published layout (model.layers.{L}: enorm, hnorm,
eh_proj, a MoE decoder block, shared_head.norm, shared_head.head, a copy of the embedding).

A random MTP layer accepts nothing, so the checkpoint is built for acceptance to mean something: every layer's
mixing (attention outputs, MLP and expert down projections) is damped by `damp`, so a token's residual stream stays
near its own embedding and the target's next token is mostly a function of the current one plus the context's
terms; the MTP layer is set to predict that function (eh_proj passes the token's normed embedding through, plus a
little of the hidden; its block is damped alike; its shared head is the target's final norm and head). Speculation
then accepts where the context terms do not move the target's choice, as a trained MTP layer accepts where it
learned the target: the figures measure the serving path with a draft that accepts, not a trained layer's τ.
"""
from __future__ import annotations

import json
import os

import torch

CONFIG = dict(vocab_size=32000, hidden_size=768, intermediate_size=2048, moe_intermediate_size=384,
              num_hidden_layers=8, num_attention_heads=12, num_key_value_heads=12, n_shared_experts=1,
              n_routed_experts=32, num_experts_per_tok=4, n_group=4, topk_group=2, first_k_dense_replace=1,
              routed_scaling_factor=2.5, norm_topk_prob=True, kv_lora_rank=224, q_lora_rank=256,
              qk_rope_head_dim=32, qk_nope_head_dim=64, v_head_dim=64, max_position_embeddings=4096,
              rope_scaling=dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=1024, beta_fast=32,
                                beta_slow=1, mscale=1.0, mscale_all_dim=1.0),
              num_nextn_predict_layers=1, bos_token_id=None, eos_token_id=None, pad_token_id=None)


EMBED_STD = 0.5


def _init(module: torch.nn.Module, gen: torch.Generator, damp: float) -> None:
    with torch.no_grad():
        for name, p in module.named_parameters():
            if p.dim() > 1:
                # the embedding well above the layers' damped outputs: the stream stays near the token's own
                p.normal_(0, EMBED_STD if "embed" in name else 0.05 if "lm_head" in name else 0.02, generator=gen)
                if name.endswith(("o_proj.weight", "down_proj.weight", "experts.down_proj")):
                    p.mul_(damp)
            elif "norm" in name:
                p.fill_(1.0)
            else:
                p.zero_()
        for name, b in module.named_buffers():
            if "e_score_correction_bias" in name:
                b.normal_(0, 0.01, generator=gen)


def build(path: str, damp: float = 0.3, seed: int = 0) -> dict:
    """Write the checkpoint to `path` (skipped when its config.json says it was built with these); returns
    {"parameters", "mtp_parameters", "damp", "seed", "config"}."""
    from safetensors.torch import load_file, save_file
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3DecoderLayer
    stamp = os.path.join(path, "built.json")
    if os.path.isfile(stamp):
        with open(stamp, encoding="utf-8") as f:
            built = json.load(f)
        if (built["damp"], built["seed"], built["config"], built.get("embed_std")) == (damp, seed, CONFIG, EMBED_STD):
            return built
    gen = torch.Generator().manual_seed(seed)
    cfg = DeepseekV3Config(**CONFIG)
    model = DeepseekV3ForCausalLM(cfg).eval()
    _init(model, gen, damp)
    model.to(torch.bfloat16).save_pretrained(path)
    index = cfg.num_hidden_layers
    block = DeepseekV3DecoderLayer(cfg, layer_idx=index)
    _init(block, gen, damp)
    pre, h = f"model.layers.{index}.", cfg.hidden_size
    mtp = {}
    for name, t in block.state_dict().items():  # the per-expert tensors as the checkpoints ship them
        if name.endswith("experts.gate_up_proj"):
            inter = t.shape[1] // 2
            for e in range(t.shape[0]):
                mtp[f"{pre}mlp.experts.{e}.gate_proj.weight"] = t[e, :inter]
                mtp[f"{pre}mlp.experts.{e}.up_proj.weight"] = t[e, inter:]
        elif name.endswith("experts.down_proj"):
            mtp.update({f"{pre}mlp.experts.{e}.down_proj.weight": t[e] for e in range(t.shape[0])})
        else:
            mtp[pre + name] = t
    mtp.update({pre + "enorm.weight": torch.ones(h), pre + "hnorm.weight": torch.ones(h),
                pre + "eh_proj.weight": torch.cat([torch.eye(h), 0.01 * torch.randn(h, h, generator=gen)], dim=1),
                pre + "shared_head.norm.weight": model.model.norm.weight.detach(),
                pre + "shared_head.head.weight": model.lm_head.weight.detach(),
                pre + "embed_tokens.weight": model.model.embed_tokens.weight.detach()})
    file = os.path.join(path, "model.safetensors")
    weights = load_file(file)
    weights.update({k: v.to(torch.bfloat16).contiguous() for k, v in mtp.items()})
    save_file(weights, file, metadata={"format": "pt"})
    built = {"parameters": sum(p.numel() for p in model.parameters()),
             "mtp_parameters": sum(v.numel() for k, v in mtp.items() if "embed_tokens" not in k),
             "damp": damp, "seed": seed, "embed_std": EMBED_STD, "config": CONFIG}
    with open(stamp, "w", encoding="utf-8") as f:
        json.dump(built, f)
    return built
