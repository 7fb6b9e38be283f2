"""The torch TreeBuilder specpd used before its list-backed one (specpd/spec/tree.py): the reference its tests
compare against (same frontiers, same finalized trees, ties included)."""
from __future__ import annotations

import torch

from specpd.spec.tree import DraftTree


class TorchTreeBuilder:
    """EAGLE-2 tree growth for one request (SGLang's select_top_k_tokens + organize_draft_results).

    Step 0 expands the root with its top-k; step s >= 1 expands the best `topk` of step s-1's new
    candidates, each with its top-k. Every candidate ever created competes in `finalize()`.
    Pool size: 1 + topk + (num_steps - 1) * topk**2 nodes, numbered in creation order.
    """

    def __init__(self, root_token: int, topk: int, num_steps: int, num_draft_tokens: int,
                 device: str | torch.device = "cpu"):
        if topk < 1 or num_steps < 1 or num_draft_tokens < 2:
            raise ValueError(f"need topk >= 1, num_steps >= 1, num_draft_tokens >= 2; got "
                             f"topk={topk}, num_steps={num_steps}, num_draft_tokens={num_draft_tokens}")
        self.topk, self.num_steps, self.num_draft_tokens = topk, num_steps, num_draft_tokens
        capacity = 1 + topk + (num_steps - 1) * topk * topk
        self._tokens = torch.full((capacity,), int(root_token), dtype=torch.long, device=device)
        self._parents = torch.full((capacity,), -1, dtype=torch.long, device=device)
        self._depth = torch.zeros(capacity, dtype=torch.long, device=device)
        self._cum = torch.zeros(capacity, device=device)
        self._proposals: list[torch.Tensor] | None = None  # per step [F * K, V] (chains only)
        self._size = 1
        self._last = (0, 1)  # node id range created by the last expand (the root before step 0)
        self.steps_done = 0

    @property
    def num_nodes(self) -> int:
        return self._size

    @property
    def done(self) -> bool:
        return self.steps_done == self.num_steps

    # Views of the pool in creation order (the drafter builds its own attention from these).
    @property
    def tokens(self) -> torch.Tensor:  # [N] long
        return self._tokens[: self._size]

    @property
    def parents(self) -> torch.Tensor:  # [N] long
        return self._parents[: self._size]

    @property
    def depth(self) -> torch.Tensor:  # [N] long
        return self._depth[: self._size]

    @property
    def cum_logprob(self) -> torch.Tensor:  # [N] float
        return self._cum[: self._size]

    def frontier(self) -> torch.Tensor:
        """[F] long pool ids to expand this step, ascending: the root at step 0, later the best `topk`
        of the last step's new nodes by (cum_logprob desc, id asc)."""
        if self.done:
            raise RuntimeError(f"all {self.num_steps} draft steps are done")
        start, end = self._last
        best = torch.sort(self._cum[start:end], descending=True, stable=True).indices[: self.topk]
        return (best + start).sort().values

    def expand(self, topk_ids: torch.Tensor, topk_probs: torch.Tensor,
               proposal_probs: torch.Tensor | None = None) -> torch.Tensor:
        """Add K children per frontier node, in frontier order then rank order.

        topk_ids [F, K] long, topk_probs [F, K] draft probs (only scores). proposal_probs [F, K, V]:
        the distribution each child was sampled from; allowed for chains (topk == 1) only, because
        keeping sampled candidates by their score biases them away from that distribution.
        Returns [F * K] new pool ids.
        """
        frontier = self.frontier()
        f, k = frontier.shape[0], self.topk
        if tuple(topk_ids.shape) != (f, k) or tuple(topk_probs.shape) != (f, k):
            raise ValueError(f"expand expects topk_ids/topk_probs of shape [{f}, {k}], "
                             f"got {tuple(topk_ids.shape)} / {tuple(topk_probs.shape)}")
        if proposal_probs is not None and k != 1:
            raise ValueError("sampled proposals need topk == 1: tree pruning by draft score is not lossless for them")
        if (proposal_probs is None) != (self._proposals is None) and self.steps_done > 0:
            raise ValueError("proposal_probs must be given at every step or at none")
        device = self._tokens.device
        start, end = self._size, self._size + f * k
        logp = torch.log(topk_probs.float().to(device)).nan_to_num(nan=float("-inf")).clamp(max=0.0)
        self._tokens[start:end] = topk_ids.to(device).reshape(-1)
        self._parents[start:end] = frontier.repeat_interleave(k)
        self._depth[start:end] = self.steps_done + 1
        # a child never outscores its parent (log p <= 0): finalize() relies on it
        self._cum[start:end] = (self._cum[frontier].unsqueeze(1) + logp).reshape(-1)
        if proposal_probs is not None:
            self._proposals = (self._proposals or []) + [proposal_probs.to(device).reshape(f * k, -1)]
        self._size, self._last = end, (start, end)
        self.steps_done += 1
        return torch.arange(start, end, device=device)

    def finalize(self) -> DraftTree:
        """The root plus the best T-1 nodes (T = min(num_draft_tokens, pool size)) by
        (cum_logprob desc, id asc), renumbered in creation order.

        Ancestor-closed even under ties: a parent has a smaller id and cum_logprob >= its child's,
        so it always ranks before the child.
        """
        n = self._size
        t = min(self.num_draft_tokens, n)
        best = torch.sort(self._cum[1:n], descending=True, stable=True).indices[: t - 1] + 1
        keep = torch.cat([best.new_zeros(1), best.sort().values])
        new_id = torch.full((n,), -1, dtype=torch.long, device=keep.device)
        new_id[keep] = torch.arange(t, device=keep.device)
        parents = torch.where(keep == 0, -1, new_id[self._parents[keep].clamp(min=0)])
        proposal = None
        if self._proposals is not None:
            rows = torch.cat(self._proposals)
            proposal = torch.cat([rows.new_zeros(1, rows.shape[1]), rows])[keep]
        return DraftTree(self._tokens[keep], parents, self._depth[keep], self._cum[keep], proposal)


def torch_attention_mask(tree: DraftTree) -> torch.Tensor:
    """DraftTree.attention_mask as it was in torch (one masked write per depth level): its reference."""
    n = tree.num_nodes
    rows = torch.arange(n)
    mask = torch.zeros(n, n, dtype=torch.bool)
    mask[rows, rows] = True
    ancestor = tree.parents.clone()
    for _ in range(tree.max_depth):
        has = ancestor >= 0
        mask[rows[has], ancestor[has]] = True
        ancestor = torch.where(has, tree.parents[ancestor.clamp(min=0)], ancestor)
    return mask


def random_tree(gen: torch.Generator, n: int, vocab: int = 4, root: int = 0) -> DraftTree:
    """A tree of n nodes (parents first), siblings' tokens distinct (as a drafter's top-k) but small, so that two
    trees share paths, and path probabilities on a coarse grid so that ties occur; a child never outscores its
    parent."""
    parents, depth, prob, tokens = [-1], [0], [1.0], [root]
    children: dict[int, int] = {}
    for i in range(1, n):
        p = int(torch.randint(0, i, (1,), generator=gen))
        parents.append(p)
        depth.append(depth[p] + 1)
        prob.append(prob[p] * int(torch.randint(1, 4, (1,), generator=gen)) / 3)  # 1/3, 2/3: rounded in float32
        if p not in children:
            children[p] = int(torch.randint(0, vocab, (1,), generator=gen))
        tokens.append(children[p])
        children[p] += 1
    return DraftTree(torch.tensor(tokens), torch.tensor(parents), torch.tensor(depth), torch.tensor(prob).log())
