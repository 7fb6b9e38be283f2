"""Replay drafter: a test and benchmark tool with known acceptance, not a stand-in for drafting.

It proposes tokens from a given reference continuation of each request (e.g. the target's own
greedy output), optionally corrupted at chosen draft depths; in a tree the right token can sit at
any sibling rank, so tree selection and KV compaction are exercised with known acceptance.
Requests without a reference get wrong proposals only (acceptance 0).
"""
from __future__ import annotations

import torch

from specpd.core import Request
from specpd.spec.draft.proposer import DraftExtend, Proposer
from specpd.spec.tree import DraftTree, TreeBuilder, root_only

# sibling probabilities by rank: high enough that the right path always survives selection
_RANK_PROBS = (0.5, 0.3, 0.12, 0.05, 0.02, 0.01)


class ReplayProposer(Proposer):
    def __init__(self, num_steps: int, topk: int, num_draft_tokens: int, vocab_size: int,
                 corrupt_depths: tuple[int, ...] = (), right_rank: int = 0):
        super().__init__(num_steps, topk, num_draft_tokens)
        if not 0 <= right_rank < topk:
            raise ValueError(f"right_rank must be in [0, topk={topk}), got {right_rank}")
        if topk > len(_RANK_PROBS):
            raise ValueError(f"replay supports topk <= {len(_RANK_PROBS)}")
        self.vocab_size = vocab_size
        self.corrupt_depths = set(corrupt_depths)
        self.right_rank = right_rank
        self.references: dict[str, list[int]] = {}  # request id -> expected output token ids

    @property
    def model_free(self) -> bool:
        return True

    def extend(self, extends: list[DraftExtend]) -> None:
        pass  # the reference is the whole state

    def _wrong(self, token: int, k: int) -> int:
        return (token + 1 + k) % self.vocab_size

    def _children(self, right: int | None, depth: int) -> tuple[list[int], list[float]]:
        """K candidates for one frontier node; `right` is the true next token (None off the path)."""
        k = self.topk
        base = right if right is not None else 0
        ids = [self._wrong(base, j) for j in range(k)]
        if right is not None and depth not in self.corrupt_depths:
            ids[self.right_rank] = right
        probs = list(_RANK_PROBS[:k]) if right is not None else [1e-4] * k
        return ids, probs

    def propose(self, requests: list[Request], starts: list[int], plans=None) -> list[DraftTree]:
        trees = []
        plans = plans or [(self.num_steps, self.num_draft_tokens)] * len(requests)
        for req, (steps, budget) in zip(requests, plans):
            if steps == 0:
                trees.append(root_only(req.all_token_ids[-1]))
                continue
            ref = self.references.get(req.request_id, [])
            done = len(req.output_token_ids)
            builder = TreeBuilder(req.all_token_ids[-1], self.topk, steps, budget)
            on_path = {0: True}  # pool id -> node lies on the (uncorrupted) reference path
            for depth in range(1, steps + 1):
                frontier = builder.frontier_ids()
                right = ref[done + depth - 1] if done + depth - 1 < len(ref) else None
                ids, probs = [], []
                for node in frontier:
                    node_ids, node_probs = self._children(right if on_path.get(node) else None, depth)
                    ids.append(node_ids)
                    probs.append(node_probs)
                new = builder.expand_ids(ids, torch.tensor(probs))
                for node, child_ids in zip(frontier, ids):
                    for j, tok in enumerate(child_ids):
                        pid = new[frontier.index(node) * self.topk + j]
                        on_path[pid] = bool(on_path.get(node)) and right is not None and tok == right
            trees.append(builder.finalize())
        return trees
