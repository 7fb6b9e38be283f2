"""Hybrid drafting (`--spec-ngram` with an EAGLE-family algorithm): one tree from two drafters.

1. The model drafter (EagleProposer) and the n-gram drafter (NgramProposer) each propose a tree for
   the round's plan.
2. `merge_trees` puts both in one trie over token paths. A node's estimated acceptance is its path
   probability under each source (the draft's cumulative probability; the n-gram's count estimate),
   combined as 1 - prod(1 - p): a path both sources propose is likelier than either alone.
3. The root plus the best num_draft_tokens - 1 nodes are kept: estimates never rise along a path, so
   the kept set is ancestor-closed. One verify forward checks it; verify does not care where a node
   came from, and the draft extend after it runs over the accepted tokens as usual.
"""
from __future__ import annotations

import numpy
import torch

from specpd.core import Request
from specpd.spec.draft.eagle_proposer import EagleProposer
from specpd.spec.draft.ngram import NgramProposer
from specpd.spec.draft.proposer import DraftExtend, Proposer
from specpd.spec.tree import DraftTree, best_ids


def merge_trees(trees: list[DraftTree], budget: int) -> DraftTree:
    """Union of trees with one root (same root token), pruned to `budget` nodes by estimated acceptance."""
    tokens, parents, depth, miss = union_trie(trees)
    # the ranking in Python on float32 scores (a round's merge was ~20 torch ops on a dozen nodes)
    score = [float(numpy.float32(1.0 - x)) for x in miss]
    score[0] = 2.0  # the root is always kept
    keep = best_ids(score, range(len(tokens)), budget)  # a child never outscores its parent, which comes first
    new_id = {old: new for new, old in enumerate(keep)}
    return DraftTree([tokens[i] for i in keep],
                     [new_id.get(parents[i], -1) for i in keep],  # as the torch version's lookup
                     [depth[i] for i in keep],
                     torch.tensor([min(score[i], 1.0) for i in keep]).clamp(min=1e-12).log())


def union_trie(trees: list[DraftTree]) -> tuple[list[int], list[int], list[int], list[float]]:
    """The trees' union over token paths, nodes in creation order (parents first): tokens, parents, depths, and
    each node's miss, the product over the trees holding it of (1 - its path probability there)."""
    root = trees[0].token_list[0]
    keys: dict[tuple[int, int], int] = {}  # (merged parent, token) -> merged node
    tokens, parents, depth, miss = [root], [-1], [0], [1.0]  # miss: prod over sources of (1 - p)
    for tree in trees:
        if tree.token_list[0] != root:
            raise ValueError(f"merge_trees: roots differ ({tree.token_list[0]} vs {root})")
        mapped = [0]
        probs = tree.cum_logprob.exp().tolist()  # float32 exp, as the torch version's
        for node, (tok, par) in enumerate(zip(tree.token_list, tree.parent_list)):
            if node == 0:
                continue
            key = (mapped[par], tok)
            m = keys.get(key)
            if m is None:
                m = keys[key] = len(tokens)
                tokens.append(tok)
                parents.append(mapped[par])
                depth.append(depth[mapped[par]] + 1)
                miss.append(1.0)
            miss[m] *= 1.0 - min(max(probs[node], 0.0), 1.0)
            mapped.append(m)
    return tokens, parents, depth, miss


class HybridProposer(Proposer):
    def __init__(self, model: EagleProposer, ngram: NgramProposer):
        super().__init__(max(model.num_steps, ngram.num_steps), model.topk, model.num_draft_tokens)
        self.model, self.ngram = model, ngram

    @property
    def aux_layer_ids(self) -> tuple[int, ...]:
        return self.model.aux_layer_ids

    @property
    def scratch_width(self) -> int:
        return self.model.scratch_width  # the n-gram half writes no draft KV

    def extend(self, extends: list[DraftExtend]) -> None:
        self.model.extend(extends)

    def propose(self, requests: list[Request], starts: list[int], plans=None) -> list[DraftTree]:
        plans = plans or [(self.model.num_steps, self.num_draft_tokens)] * len(requests)
        model_trees = self.model.propose(requests, starts, [(min(s, self.model.num_steps), b) for s, b in plans])
        # the n-gram half costs no forward: when the round speculates at all it drafts its full depth
        ngram_trees = self.ngram.propose(requests, starts, [(self.ngram.num_steps if s else 0, b) for s, b in plans])
        return [a if s == 0 else merge_trees([a, b], budget)
                for a, b, (s, budget) in zip(model_trees, ngram_trees, plans)]

    def release(self, request: Request) -> None:
        self.ngram.release(request)
        self.model.release(request)
