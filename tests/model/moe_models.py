"""Tiny random DeepSeek-V3 and GLM-4.5 MoE models built with transformers' own classes, saved as HF directories,
optionally with the MTP (NextN) layers their releases ship after the last decoder layer (transformers drops
those weights, so they are written here, random, in the published layout), and a torch reference of one MTP
layer over transformers' own decoder layer."""
from __future__ import annotations

import os

import torch
from safetensors.torch import load_file, save_file

TINY = dict(vocab_size=320, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=3,
            num_attention_heads=4, n_shared_experts=1, n_routed_experts=8, num_experts_per_tok=3,
            first_k_dense_replace=1, max_position_embeddings=512, bos_token_id=None, eos_token_id=None,
            pad_token_id=None)
FAMILIES = {
    # q LoRA, YaRN with mscale, interleaved RoPE, 4 groups of 2 experts (2 kept), normalized top-k, latent 32 + 8
    "deepseek": dict(kv_lora_rank=32, q_lora_rank=48, qk_rope_head_dim=8, v_head_dim=16, qk_nope_head_dim=16,
                     n_group=4, topk_group=2, routed_scaling_factor=2.5, norm_topk_prob=True,
                     rope_scaling=dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=128,
                                       beta_fast=32, beta_slow=1, mscale=1.0, mscale_all_dim=1.0)),
    # V2-Lite-like: no q LoRA, plain RoPE not interleaved, one group, unnormalized top-k, an odd latent (27 + 6)
    "deepseek-lite": dict(kv_lora_rank=27, q_lora_rank=None, qk_rope_head_dim=6, v_head_dim=12, qk_nope_head_dim=10,
                          n_group=1, topk_group=1, routed_scaling_factor=1.0, norm_topk_prob=False,
                          rope_interleave=False, first_k_dense_replace=2),
    # GLM-4.5: GQA 4/2 with q/k/v bias, q/k norm, partial RoPE (half of 16 dims), two groups of 4 (1 kept)
    "glm": dict(num_key_value_heads=2, head_dim=16, attention_bias=True, use_qk_norm=True, n_group=2,
                topk_group=1, routed_scaling_factor=1.5, norm_topk_prob=True),
}


def tiny_moe_config(family: str, **overrides):
    from transformers import DeepseekV3Config, Glm4MoeConfig
    kw = {**TINY, **FAMILIES[family], **overrides}
    if family.startswith("deepseek"):
        kw.setdefault("num_key_value_heads", kw["num_attention_heads"])
        return DeepseekV3Config(**kw)
    return Glm4MoeConfig(**kw)


def _randomize(module: torch.nn.Module, gen: torch.Generator) -> None:
    """Weights large enough that greedy outputs are not degenerate; norms near 1; a nonzero routing bias."""
    with torch.no_grad():
        for name, p in module.named_parameters():
            if p.dim() > 1:
                p.normal_(0, 0.25 if "embed" in name or "lm_head" in name or "head" in name else 0.08, generator=gen)
            elif "norm" in name:
                p.normal_(1.0, 0.1, generator=gen)
            else:
                p.normal_(0, 0.1, generator=gen)
        for name, b in module.named_buffers():
            if "e_score_correction_bias" in name:
                b.normal_(0, 0.05, generator=gen)


def hf_classes(family: str):
    """(ForCausalLM, DecoderLayer, RMSNorm, RotaryEmbedding) of the family in transformers."""
    if family.startswith("deepseek"):
        from transformers.models.deepseek_v3 import modeling_deepseek_v3 as m
        return m.DeepseekV3ForCausalLM, m.DeepseekV3DecoderLayer, m.DeepseekV3RMSNorm, m.DeepseekV3RotaryEmbedding
    from transformers.models.glm4_moe import modeling_glm4_moe as m
    return m.Glm4MoeForCausalLM, m.Glm4MoeDecoderLayer, m.Glm4MoeRMSNorm, m.Glm4MoeRotaryEmbedding


def damp_mixing(module: torch.nn.Module, alpha: float) -> None:
    """Scale every attention output and MLP / expert down projection by alpha: each token's residual stream stays
    close to its own embedding, so the next token is mostly a function of the current one (plus the context)."""
    with torch.no_grad():
        for name, p in module.named_parameters():
            if name.endswith(("o_proj.weight", "down_proj.weight", "experts.down_proj")):
                p.mul_(alpha)


def save_tiny_moe(family: str, path, seed: int = 0, nextn: int = 0, own_head: bool = True,
                  predictable: float | None = None, **overrides):
    """Build a random model, save it; with `nextn` MTP layers appended to its safetensors in the published layout
    (model.layers.{L + i}: enorm, hnorm, eh_proj, a MoE decoder block, shared_head.norm, shared_head.head where
    own_head, and a copy of the embedding, as DeepSeek-V3's layer 61). Returns (HF model, {MTP key: tensor}).

    predictable (alpha): a target whose every layer's mixing is damped by alpha (`damp_mixing`) and MTP layers that
    predict it: eh_proj passes the token's normed embedding through (and a little of the hidden), the block is damped
    alike and the shared head is the target's final norm and head, so an MTP layer fed x_{p+1} predicts what the
    target will at p + 1 up to the target's context terms: acceptance is high, not total, and depends on the KV."""
    causal_lm, _, _, _ = hf_classes(family)
    gen = torch.Generator().manual_seed(seed)
    cfg = tiny_moe_config(family, num_nextn_predict_layers=max(nextn, 1), **overrides)
    model = causal_lm(cfg).eval()
    _randomize(model, gen)
    if predictable is not None:
        damp_mixing(model, predictable)
    model.save_pretrained(path)
    mtp = {}
    for i in range(nextn):
        mtp.update(nextn_layer_weights(family, cfg, model, cfg.num_hidden_layers + i, gen, own_head, predictable))
    if mtp:
        file = os.path.join(path, "model.safetensors")
        save_file({**load_file(file), **mtp}, file, metadata={"format": "pt"})
    return model, mtp


def nextn_layer_weights(family: str, cfg, model, index: int, gen: torch.Generator, own_head: bool,
                        predictable: float | None = None) -> dict:
    """Random MTP layer `index` in the published layout; its decoder block is transformers' own layer `index`
    (a MoE layer), its per-expert tensors split as the checkpoints ship them. predictable: save_tiny_moe's."""
    _, decoder_layer, _, _ = hf_classes(family)
    block = decoder_layer(cfg, layer_idx=index).eval()
    _randomize(block, gen)
    if predictable is not None:
        damp_mixing(block, predictable)
    pre = f"model.layers.{index}."
    out = {}
    for name, t in block.state_dict().items():
        if name.endswith("experts.gate_up_proj"):
            inter = t.shape[1] // 2
            for e in range(t.shape[0]):
                out[f"{pre}mlp.experts.{e}.gate_proj.weight"] = t[e, :inter].clone()
                out[f"{pre}mlp.experts.{e}.up_proj.weight"] = t[e, inter:].clone()
        elif name.endswith("experts.down_proj"):
            for e in range(t.shape[0]):
                out[f"{pre}mlp.experts.{e}.down_proj.weight"] = t[e].clone()
        else:
            out[pre + name] = t.clone()
    h = cfg.hidden_size
    out[pre + "enorm.weight"] = 1.0 + 0.1 * torch.randn(h, generator=gen)
    out[pre + "hnorm.weight"] = 1.0 + 0.1 * torch.randn(h, generator=gen)
    out[pre + "eh_proj.weight"] = 0.08 * torch.randn(h, 2 * h, generator=gen)
    out[pre + "shared_head.norm.weight"] = 1.0 + 0.1 * torch.randn(h, generator=gen)
    out[pre + "embed_tokens.weight"] = model.model.embed_tokens.weight.detach().clone()
    if own_head:
        out[pre + "shared_head.head.weight"] = model.lm_head.weight.detach().clone()
    if predictable is not None:
        out[pre + "enorm.weight"] = torch.ones(h)
        out[pre + "eh_proj.weight"] = torch.cat([torch.eye(h), 0.02 * torch.randn(h, h, generator=gen)], dim=1)
        out[pre + "shared_head.norm.weight"] = model.model.norm.weight.detach().clone()
    return out


@torch.no_grad()
def reference_mtp_logits(family: str, model, mtp: dict, index: int, tokens: list[int], hidden: torch.Tensor
                         ) -> torch.Tensor:
    """The NextN math in torch over transformers' decoder layer: position p pairs token x_{p+1} (`tokens`, already
    shifted) with the target's normed final hidden at p (`hidden` [n, H]) ->
    head(shared_head.norm(block(eh_proj([enorm(embed(x)); hnorm(h)])))) [n, vocab], causal over the n positions."""
    _, decoder_layer, rms_norm, rotary = hf_classes(family)
    cfg = model.config
    pre = f"model.layers.{index}."
    block = decoder_layer(cfg, layer_idx=index).eval()
    state = {k[len(pre):]: v for k, v in mtp.items() if k.startswith(pre)}
    experts = {}
    for key in [k for k in state if ".experts." in k]:
        _, e, proj, _ = key.rsplit(".", 3)
        experts.setdefault(proj, {})[int(e)] = state.pop(key)
    num = cfg.n_routed_experts
    state["mlp.experts.gate_up_proj"] = torch.stack([torch.cat([experts["gate_proj"][e], experts["up_proj"][e]])
                                                     for e in range(num)])
    state["mlp.experts.down_proj"] = torch.stack([experts["down_proj"][e] for e in range(num)])
    block.load_state_dict({k: v for k, v in state.items() if k.split(".")[0] in ("self_attn", "mlp", "input_layernorm",
                                                                                "post_attention_layernorm")})

    def norm(name):
        n = rms_norm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        n.weight.copy_(mtp[pre + name])
        return n

    embed = model.model.embed_tokens(torch.tensor([tokens]))
    x = torch.cat([norm("enorm.weight")(embed), norm("hnorm.weight")(hidden.unsqueeze(0))], dim=-1)
    x = x @ mtp[pre + "eh_proj.weight"].T
    n = len(tokens)
    positions = torch.arange(n).unsqueeze(0)
    mask = torch.full((n, n), float("-inf")).triu(1)[None, None]
    h = block(x, attention_mask=mask, position_ids=positions, position_embeddings=rotary(cfg)(x, positions))
    head = mtp.get(pre + "shared_head.head.weight", model.lm_head.weight)
    return norm("shared_head.norm.weight")(h)[0] @ head.T
