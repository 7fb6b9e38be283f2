"""Dense causal attention for training drafts: the serving backends write K/V into a paged pool
in place, which autograd cannot see through across steps; this backend keeps each unrolled step's
K/V as graph tensors instead and reuses the draft's own modules (rope, projections) unchanged.

Rows of a training batch are padded to one length S and flattened row-major into the draft's
[T = B * S] token axis. Step 0 is plain causal attention over the row. Unrolled step k > 0 is what
chain drafting does at inference (eagle_proposer.py): row p at step k stands for the draft node
at position p + k whose committed prefix ends at position p, so it sees the step-0 keys 0..p
(KV the draft extend wrote from target features), the keys of row p at steps 1..k-1 (its
ancestors' scratch slots) and itself. Padding sits at the end of a row, so it never leaks into
earlier positions.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class DenseMeta:
    """Stands in for AttentionMetadata: drafts pass `meta` through to their backend untouched."""

    batch: int  # B rows
    seq_len: int  # S positions per row (padded)
    step: int  # unrolled draft step k, 0 = the extend over target features


class DenseTrainingBackend:
    """AttentionBackend-shaped (forward(q, k, v, layer_id, meta)); one instance per training batch.

    K/V of earlier steps are kept per layer for the unrolled steps and dropped by `reset()`.
    """

    name = "dense-train"

    def __init__(self, num_q_heads: int, head_dim: int, sm_scale: float | None = None):
        self.num_q_heads = num_q_heads
        self.head_dim = head_dim
        self.sm_scale = sm_scale if sm_scale is not None else head_dim ** -0.5
        self._kv: dict[int, list[tuple[torch.Tensor, torch.Tensor]]] = {}  # layer -> [(k, v)] per step

    def reset(self) -> None:
        self._kv.clear()

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int,
                meta: DenseMeta) -> torch.Tensor:
        """q [T, Hq, D], k/v [T, Hkv, D] with T = B * S -> out [T, Hq, D]."""
        b, s = meta.batch, meta.seq_len
        qb = q.view(b, s, -1, self.head_dim).transpose(1, 2)  # [B, Hq, S, D]
        kb = k.view(b, s, -1, self.head_dim).transpose(1, 2)  # [B, Hkv, S, D]
        vb = v.view(b, s, -1, self.head_dim).transpose(1, 2)
        steps = self._kv.setdefault(layer_id, [])
        if meta.step != len(steps):
            raise RuntimeError(f"dense attention: layer {layer_id} got step {meta.step} after {len(steps)} "
                               "steps; call reset() between batches and run steps in order")
        steps.append((kb, vb))
        if meta.step == 0:
            out = F.scaled_dot_product_attention(qb, kb, vb, is_causal=True, scale=self.sm_scale, enable_gqa=True)
        else:
            keys = torch.cat([kv[0] for kv in steps], dim=2)  # [B, Hkv, (k + 1) * S, D]
            values = torch.cat([kv[1] for kv in steps], dim=2)
            out = F.scaled_dot_product_attention(qb, keys, values, attn_mask=unrolled_mask(s, meta.step, q.device),
                                                 scale=self.sm_scale, enable_gqa=True)
        return out.transpose(1, 2).reshape(q.shape)


def unrolled_mask(seq_len: int, step: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """[S, (step + 1) * S] bool, True = attend: causal over the step-0 block, the diagonal of every
    later step's block (row p sees only its own nodes of steps 1..step)."""
    causal = torch.ones(seq_len, seq_len, dtype=torch.bool, device=device).tril()
    diag = torch.eye(seq_len, dtype=torch.bool, device=device)
    return torch.cat([causal] + [diag] * step, dim=1)
