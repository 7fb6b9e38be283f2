"""Mixture of experts of DeepSeek-V3 and GLM-4.5: a router, routed experts, shared experts.

Per token x (transformers' DeepseekV3MoE / Glm4MoeMoE, the same module):
  1. router: logits = x W_g^T in fp32; scores = sigmoid(logits) (or softmax, DeepSeek-V2's scoring_func);
  2. choice (topk_method): noaux_tc adds e_score_correction_bias to the scores for the choice only, scores each of
     n_group groups by the sum of its top-2, keeps the topk_group best groups and takes the top
     num_experts_per_tok experts inside them; group_limited_greedy scores a group by its best expert; greedy takes
     the top experts with no groups;
  3. weights: the chosen experts' unbiased scores, normalized to sum to 1 where norm_topk_prob, times
     routed_scaling_factor;
  4. out = sum_k weight_k * expert_k(x) + shared_experts(x), each expert a SiLU-gated MLP.
The experts run batched: the step's (token, choice) pairs are grouped by expert and each expert that any token chose
runs once over its tokens (one gather, its two GEMMs, one index_add into the output in expert order, as
transformers adds them), so no Python loop runs per token. Router weight and bias stay fp32 whatever the model's
dtype (transformers' _keep_in_fp32_modules_strict). A checkpoint's per-expert tensors
(mlp.experts.{e}.{gate,up,down}_proj.weight) load into expert e's fused MLP (`moe_slots`).
"""
from __future__ import annotations

from dataclasses import replace

import torch
from torch import nn

from specpd.config import ModelConfig
from specpd.model.llama import MLP


class Router(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        moe = cfg.moe
        self.moe = moe
        # [E, H] fp32: a linear so that the CPU path packs it (the project's fp32 GEMM: a token routes alike in any
        # batch, which a greedy verify row needs to equal its decode row)
        self.proj = nn.Linear(cfg.hidden_size, moe.num_experts, bias=False)
        self.register_buffer("e_score_correction_bias", torch.zeros(moe.num_experts))  # [E] fp32

    def _apply(self, fn, recurse=True):
        """A dtype cast of the model leaves the router fp32 (a device move moves it)."""
        kept = (self.proj.weight.data, self.e_score_correction_bias)
        super()._apply(fn, recurse)
        if not kept[0].is_meta:
            self.proj.weight.data = kept[0].to(self.proj.weight.device)
            self.e_score_correction_bias = kept[1].to(self.proj.weight.device)
        return self

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, H] -> (weights [T, K] fp32, expert ids [T, K] int64)."""
        moe = self.moe
        logits = self.proj(x.float())  # [T, E] fp32
        scores = logits.sigmoid() if moe.scoring_func == "sigmoid" else logits.softmax(dim=-1)
        choice = scores + self.e_score_correction_bias if moe.topk_method == "noaux_tc" else scores
        if moe.topk_method != "greedy":
            grouped = choice.view(-1, moe.n_group, moe.num_experts // moe.n_group)  # [T, G, E / G]
            group_scores = (grouped.topk(2, dim=-1)[0].sum(dim=-1) if moe.topk_method == "noaux_tc"
                            else grouped.max(dim=-1).values)  # [T, G]
            group_idx = torch.topk(group_scores, k=moe.topk_group, dim=-1, sorted=False)[1]
            group_mask = torch.zeros_like(group_scores).scatter_(1, group_idx, 1)
            keep = group_mask.unsqueeze(-1).expand_as(grouped).reshape(-1, moe.num_experts)
            choice = choice.masked_fill(~keep.bool(), float("-inf"))
        ids = torch.topk(choice, k=moe.num_experts_per_tok, dim=-1, sorted=False)[1]  # [T, K]
        weights = scores.gather(1, ids)
        if moe.norm_topk_prob:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return weights * moe.routed_scaling_factor, ids


class Experts(nn.ModuleList):
    """The routed experts, expert e a SiLU-gated MLP (gate/up fused, as the dense layers'), packed for the CPU GEMM
    path like every other linear (batch invariant: a token's expert output does not depend on who shares it)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__(MLP(replace(cfg, intermediate_size=cfg.moe.moe_intermediate_size))
                         for _ in range(cfg.moe.num_experts))

    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """x [T, H], weights / ids [T, K] -> sum over k of weights[:, k] * expert_{ids[:, k]}(x) [T, H]."""
        k = ids.shape[1]
        flat = ids.flatten()  # [T * K]
        order = flat.argsort(stable=True)  # (token, choice) pairs grouped by expert
        counts = torch.bincount(flat, minlength=len(self)).tolist()
        flat_weights = weights.flatten()
        out = torch.zeros_like(x)
        start = 0
        for expert, n in enumerate(counts):
            if n == 0:
                continue
            pairs = order[start:start + n]
            start += n
            tokens = pairs // k
            y = self[expert](x.index_select(0, tokens)) * flat_weights.index_select(0, pairs).unsqueeze(1)
            out.index_add_(0, tokens, y.to(out.dtype))
        return out


class MoE(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        moe = cfg.moe
        self.gate = Router(cfg)
        self.experts = Experts(cfg)
        shared = moe.moe_intermediate_size * moe.n_shared_experts
        self.shared_experts = MLP(replace(cfg, intermediate_size=shared)) if shared else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = self.gate(x)
        out = self.experts(x, weights, ids)
        return out if self.shared_experts is None else out + self.shared_experts(x)


def moe_slots(pub: str, mod: str, cfg: ModelConfig) -> dict[str, tuple[str, tuple[int, int] | None]]:
    """{checkpoint key: (parameter, its row range or None)} of one MoE block: the per-expert layout DeepSeek and GLM
    ship (mlp.experts.{e}.{gate,up,down}_proj.weight), the router, the shared experts (gate/up fused)."""
    moe = cfg.moe
    inter, shared = moe.moe_intermediate_size, moe.moe_intermediate_size * moe.n_shared_experts
    slots = {f"{pub}mlp.gate.weight": (f"{mod}mlp.gate.proj.weight", None),
             f"{pub}mlp.gate.e_score_correction_bias": (f"{mod}mlp.gate.e_score_correction_bias", None)}
    for e in range(moe.num_experts):
        slots.update(mlp_slots(f"{pub}mlp.experts.{e}.", f"{mod}mlp.experts.{e}.", inter))
    if shared:
        slots.update(mlp_slots(f"{pub}mlp.shared_experts.", f"{mod}mlp.shared_experts.", shared))
    return slots


def mlp_slots(pub: str, mod: str, inter: int) -> dict[str, tuple[str, tuple[int, int] | None]]:
    """A SiLU-gated MLP's gate_proj / up_proj / down_proj -> its fused gate_up_proj and down_proj."""
    return {f"{pub}gate_proj.weight": (f"{mod}gate_up_proj.weight", (0, inter)),
            f"{pub}up_proj.weight": (f"{mod}gate_up_proj.weight", (inter, 2 * inter)),
            f"{pub}down_proj.weight": (f"{mod}down_proj.weight", None)}
