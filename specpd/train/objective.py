"""The draft training objective: an unrolled draft forward over dense attention, and its losses.

Alignment (the serving convention of specpd/spec/draft/base.py): the draft row at position p pairs token
x_{p+1} with the target feature f_p and predicts x_{p+2}. Its training signal is the target's own
next-token distribution at position p + 1, softmax(head(h_{p+1})) with h the target's normed final
hidden, recomputed from the cache through the frozen head. Unrolled step k (training-time test,
EAGLE-3 style) feeds row p the token x_{p+1+k} and the draft's step k-1 output hidden at row p, at
position p + k, and predicts x_{p+2+k} against the target's distribution at p + 1 + k.

Losses per step k, averaged over rows whose predicted token x_{p+2+k} is an assistant token:
  - ce: soft cross-entropy  -sum_v p_target(v) log q_draft(v)  (= KL up to the target's entropy).
    With a reduced draft vocab the target distribution is renormalised over the draft vocab, and
    rows whose target argmax lies outside it are skipped (EAGLE-3's position mask);
  - feature (EAGLE-1): smooth L1 between the draft output and h_{p+1+k}, the hidden the target head
    reads (EAGLE-1 regresses features; EAGLE-3 and MTP train on ce only).
total = sum_k decay^k (ce_weight * ce_k + feature_weight * feature_k).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from specpd.spec.draft.base import DraftModel
from specpd.train.dense_attention import DenseMeta, DenseTrainingBackend


@dataclass
class TrainBatch:
    """Rows padded at the end to one length S; padding has input id 0 and loss mask 0."""

    input_ids: torch.Tensor  # [B, S] long, target vocab
    features: torch.Tensor  # [B, S, Hin] fp32, the draft's step-0 hidden input f_p
    target_hidden: torch.Tensor  # [B, S, H] fp32, target normed final hidden h_p
    target_argmax: torch.Tensor  # [B, S] long, argmax of the target's full-vocab logits at p
    loss_mask: torch.Tensor  # [B, S] fp32, 1 = token p is an assistant token
    num_tokens: int  # real (unpadded) tokens

    @classmethod
    def collate(cls, seqs: list[dict[str, torch.Tensor]], feature_key: str) -> "TrainBatch":
        """seqs: per conversation {input_ids [n], loss_mask [n], target_argmax [n], hidden [n, H],
        feature_key [n, Hin]} as stored in the feature cache."""
        s = max(len(x["input_ids"]) for x in seqs)

        def pad(key: str, dtype: torch.dtype) -> torch.Tensor:
            rows = [x[key].to(dtype) for x in seqs]
            out = rows[0].new_zeros((len(rows), s) + tuple(rows[0].shape[1:]))
            for i, r in enumerate(rows):
                out[i, :len(r)] = r
            return out

        return cls(input_ids=pad("input_ids", torch.long), features=pad(feature_key, torch.float32),
                   target_hidden=pad("hidden", torch.float32), target_argmax=pad("target_argmax", torch.long),
                   loss_mask=pad("loss_mask", torch.float32), num_tokens=sum(len(x["input_ids"]) for x in seqs))


def shift(x: torch.Tensor, n: int) -> torch.Tensor:
    """x[:, n:] padded with zeros back to x's length: row p gets the value at p + n."""
    if n == 0:
        return x
    return torch.cat([x[:, n:], x.new_zeros((x.shape[0], min(n, x.shape[1])) + tuple(x.shape[2:]))], dim=1)


class DraftObjective:
    def __init__(self, draft: DraftModel, head_rows: torch.Tensor, steps: int = 1, ce_weight: float = 1.0,
                 feature_weight: float = 0.0, step_decay: float = 0.8, autocast_bf16: bool = False):
        """head_rows [draft_vocab, H]: the target's frozen LM head rows of the draft vocab."""
        if steps < 1:
            raise ValueError(f"unrolled steps must be >= 1, got {steps}")
        self.draft = draft
        self.head_rows = head_rows.detach().float()
        self.steps = steps
        self.ce_weight = ce_weight
        self.feature_weight = feature_weight
        self.step_decay = step_decay
        self.autocast_bf16 = autocast_bf16
        cfg = draft.config
        self.backend = DenseTrainingBackend(cfg.num_heads, cfg.head_dim)

    def __call__(self, batch: TrainBatch) -> tuple[torch.Tensor, dict[str, float]]:
        draft = self.draft
        b, s = batch.input_ids.shape
        self.backend.reset()
        in_vocab = (draft.t2d[batch.target_argmax].float() if draft.t2d is not None
                    else torch.ones_like(batch.loss_mask))  # [B, S]
        hidden = batch.features.reshape(b * s, -1)
        positions = torch.arange(s).repeat(b)  # [B * S]
        total = batch.features.new_zeros(())
        metrics: dict[str, float] = {}
        for k in range(self.steps):
            weight = (shift(batch.loss_mask, 2 + k) * shift(in_vocab, 1 + k)).reshape(-1)  # [B * S]
            ids = shift(batch.input_ids, 1 + k).reshape(-1)
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=self.autocast_bf16):
                out = draft(ids, hidden, positions + k, self.backend, DenseMeta(b, s, k), step=k)  # [B * S, H]
            out = out.float()
            rows = weight > 0
            n = rows.sum().clamp(min=1)
            target_h = shift(batch.target_hidden, 1 + k).reshape(b * s, -1)[rows]  # [R, H]
            with torch.no_grad():
                target_p = torch.softmax(target_h @ self.head_rows.T, dim=-1)  # [R, V]
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=self.autocast_bf16):
                logits = draft.compute_logits(out[rows], step=k)
            logq = torch.log_softmax(logits.float(), dim=-1)
            w = weight[rows]
            ce = -((target_p * logq).sum(-1) * w).sum() / n
            step_loss = self.ce_weight * ce
            if self.feature_weight:
                feat = (F.smooth_l1_loss(out[rows], target_h, reduction="none").mean(-1) * w).sum() / n
                step_loss = step_loss + self.feature_weight * feat
                metrics[f"feat{k}"] = float(feat.detach())
            total = total + self.step_decay ** k * step_loss
            with torch.no_grad():
                target_top = shift(batch.target_argmax, 1 + k).reshape(-1)[rows]
                hit = draft.draft_to_target(logq.argmax(-1)) == target_top
                metrics[f"ce{k}"] = float(ce)
                metrics[f"acc{k}"] = float((hit.float() * w).sum() / n)
            hidden = out
        metrics["loss"] = float(total.detach())
        return total, metrics
