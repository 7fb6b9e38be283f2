"""The MoE families' parts against transformers and short references: the router (noaux_tc with the correction
bias, DeepSeek-V3's and GLM-4.5's; greedy, group-limited greedy and softmax scoring against DeepSeek-V2's formula),
the batched experts, YaRN's frequencies and attention factor, and FP8 block dequantization at load."""
import os

import pytest
import torch
from safetensors.torch import load_file, save_file

from specpd.config import ModelConfig
from specpd.core import SamplingParams
from specpd.model.fp8 import dequantize_fp8
from specpd.model.moe import Experts, Router
from specpd.model.rope_scaling import family_inv_freq
from tests.model.moe_models import save_tiny_moe, tiny_moe_config
from tests.model.test_moe_families import make_engine


def config_and_ours(family: str, **overrides):
    hf = tiny_moe_config(family, **overrides)
    return hf, ModelConfig.from_hf({**hf.to_dict(), **overrides})


@pytest.mark.parametrize("family", ["deepseek", "glm"])
def test_router_and_experts_equal_transformers(family):
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3Experts, DeepseekV3TopkRouter
    from transformers.models.glm4_moe.modeling_glm4_moe import Glm4MoeTopkRouter
    hf_cfg, cfg = config_and_ours(family)
    hf_router = (DeepseekV3TopkRouter if family == "deepseek" else Glm4MoeTopkRouter)(hf_cfg)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        hf_router.weight.normal_(0, 0.3, generator=gen)
        hf_router.e_score_correction_bias.normal_(0, 0.1, generator=gen)
    ours = Router(cfg)
    ours.load_state_dict({"proj.weight": hf_router.weight, "e_score_correction_bias": hf_router.e_score_correction_bias})
    x = torch.randn(40, cfg.hidden_size, generator=gen)
    _, want_w, want_ids = hf_router(x)
    got_w, got_ids = ours(x)
    order_w, order_g = want_ids.argsort(-1), got_ids.argsort(-1)
    assert torch.equal(want_ids.gather(1, order_w), got_ids.gather(1, order_g))
    assert torch.equal(want_w.gather(1, order_w), got_w.gather(1, order_g))
    hf_experts = DeepseekV3Experts(hf_cfg)
    with torch.no_grad():
        hf_experts.gate_up_proj.normal_(0, 0.1, generator=gen)
        hf_experts.down_proj.normal_(0, 0.1, generator=gen)
    experts = Experts(cfg)
    inter = cfg.moe.moe_intermediate_size
    with torch.no_grad():
        for e, mlp in enumerate(experts):
            mlp.gate_up_proj.weight.copy_(hf_experts.gate_up_proj[e])
            mlp.down_proj.weight.copy_(hf_experts.down_proj[e])
            assert mlp.gate_up_proj.weight.shape == (2 * inter, cfg.hidden_size)
        assert torch.allclose(experts(x, got_w, got_ids), hf_experts(x, want_ids, want_w), atol=1e-6)


@pytest.mark.parametrize("method,scoring", [("greedy", "softmax"), ("group_limited_greedy", "softmax"),
                                            ("noaux_tc", "softmax"), ("greedy", "sigmoid")])
def test_router_methods_match_deepseek_v2_formula(method, scoring):
    _, cfg = config_and_ours("deepseek", topk_method=method, scoring_func=scoring)
    router = Router(cfg)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        router.proj.weight.normal_(0, 0.3, generator=gen)
        router.e_score_correction_bias.normal_(0, 0.1, generator=gen)
    x = torch.randn(32, cfg.hidden_size, generator=gen)
    weights, ids = router(x)
    moe = cfg.moe
    logits = x @ router.proj.weight.T
    scores = logits.softmax(-1) if scoring == "softmax" else logits.sigmoid()
    choice = scores + router.e_score_correction_bias if method == "noaux_tc" else scores.clone()
    if method != "greedy":
        grouped = choice.view(32, moe.n_group, -1)
        group_score = grouped.topk(2, -1)[0].sum(-1) if method == "noaux_tc" else grouped.max(-1).values
        dropped = group_score.topk(moe.n_group - moe.topk_group, -1, largest=False)[1]
        for t in range(32):
            grouped[t, dropped[t]] = float("-inf")
    want_ids = choice.topk(moe.num_experts_per_tok, -1)[1]
    want = scores.gather(1, want_ids)
    want = want / want.sum(-1, keepdim=True) * moe.routed_scaling_factor
    assert torch.equal(ids.sort(-1).values, want_ids.sort(-1).values)
    assert torch.allclose(weights.gather(1, ids.argsort(-1)), want.gather(1, want_ids.argsort(-1)), atol=1e-6)


def test_yarn_frequencies_and_attention_factor_equal_transformers():
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    hf_cfg, cfg = config_and_ours("deepseek", rope_scaling=dict(rope_type="yarn", factor=40.0, beta_fast=32,
                                                                beta_slow=1, mscale=0.707, mscale_all_dim=1.0,
                                                                original_max_position_embeddings=64))
    want, want_factor = ROPE_INIT_FUNCTIONS["yarn"](hf_cfg)
    got, factor = family_inv_freq(cfg)
    assert torch.equal(got, want) and factor == pytest.approx(want_factor, rel=1e-12) and factor != 1.0


def test_fp8_block_dequantization(tmp_path):
    gen = torch.Generator().manual_seed(2)
    codes = (torch.randn(10, 20, generator=gen) * 8).to(torch.float8_e4m3fn)
    scale = torch.rand(3, 3, generator=gen) + 0.5  # blocks of 4 x 8, the last ones partial
    out = dequantize_fp8({"w.weight": codes.float(), "w.weight_scale_inv": scale, "b": torch.ones(2)}, (4, 8))
    want = codes.float().clone()
    for i in range(10):
        for j in range(20):
            want[i, j] *= scale[i // 4, j // 8]
    assert set(out) == {"w.weight", "b"} and torch.equal(out["w.weight"], want)
    with pytest.raises(ValueError, match="is \\(2, 2\\) for a 10x20 weight in 4x8 blocks"):
        dequantize_fp8({"w.weight": codes.float(), "w.weight_scale_inv": scale[:2, :2]}, (4, 8))
    # a checkpoint whose linears ship as e4m3 codes + scales serves as its dequantized weights do
    plain, quant = tmp_path / "plain", tmp_path / "fp8"
    save_tiny_moe("deepseek", plain)
    save_tiny_moe("deepseek", quant)
    file = os.path.join(quant, "model.safetensors")
    weights = load_file(file)
    for name in [k for k in weights if k.endswith("proj.weight") and "layers.1." in k]:
        fp8 = weights[name].to(torch.float8_e4m3fn)
        s = torch.tensor([[0.5]])
        weights[name], weights[name + "_scale_inv"] = fp8, s
        plain_file = os.path.join(plain, "model.safetensors")
        w = load_file(plain_file)
        w[name] = fp8.float() * 0.5
        save_file(w, plain_file, metadata={"format": "pt"})
    save_file(weights, file, metadata={"format": "pt"})
    prompts, greedy = [[5, 17, 99, 3], list(range(40, 60))], SamplingParams(max_tokens=8, temperature=0.0)
    outs = [[o.token_ids for o in make_engine(str(p)).generate(prompts, greedy)] for p in (plain, quant)]
    assert outs[0] == outs[1]
