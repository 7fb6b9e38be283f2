"""Lossless verify: which proposed tokens the target keeps, and the bonus token it adds.

Vocabulary (used across specpd):
- proposed: the draft tokens in the tree (every node but the root).
- accepted: proposed tokens the target keeps; they form one path down from the root.
- rejected: the other proposed tokens (tried and refused, or never reached).
- bonus: the one token the target itself samples after the last accepted one: from the residual
  distribution if a candidate there was rejected, else from the target distribution at that node.
- acceptance length tau: tokens committed per verify forward, bonus included (= accepted + 1).

Recursive multi-candidate rejection (SpecInfer; SGLang tree_speculative_sampling), per request, where
p(n) is the target's processed distribution at node n (specpd.model.sampler.process_logits, so
temperature, top-k/top-p/min-p and penalties are honoured):
1. Start at the root with residual r = p(root).
2. Try the node's children in sibling order. Candidate c, token x, proposed from q_c (one-hot on x
   for top-k trees; the drafter's distribution for sampled ones): accept with min(1, r(x) / q_c(x)).
3. Accepted: descend into c with r = p(c). Rejected: r <- norm(max(0, r - q_c)), next sibling.
4. No child left to try (all rejected, or a leaf): bonus ~ r.
Each candidate is plain speculative sampling of the target r from the proposal q_c whose fallback is
the next step, so by induction the committed tokens follow the target exactly. A chain is the tree
with one child per node. A residual with no mass left (only by rounding, r == q_c) falls back to
p(node); that moves at most ~1e-6 of probability.
Lossless needs q_c to be the distribution c was really drawn from (given its earlier siblings), and
c's presence in the tree not to depend on its token. Top-k trees meet this however they are pruned
(one-hot q); sampled proposals do for chains and for trees that keep every sampled child, which is
why TreeBuilder takes proposals only for chains.

Randomness: T uniforms per request from its own torch.Generator, drawn whatever the outcome (so a
seeded request replays): coin c decides node c; coin 0 (the root is never tested) draws the bonus by
inverse CDF. Greedy requests draw nothing and go through specpd.spec.verify.greedy.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from specpd.spec.verify.greedy import verify_greedy
from specpd.spec.tree import DraftTree

_EMPTY_RESIDUAL = 1e-6  # residual mass below this is rounding noise


@dataclass
class VerifyResult:
    accepted_nodes: list[int]  # tree node ids along the accepted path, root excluded
    accepted_tokens: list[int]
    bonus_token: int
    accept_flags: list[bool]  # [tree max depth]: flags[d] = the proposal at depth d + 1 was accepted

    @property
    def accept_len(self) -> int:
        return len(self.accepted_nodes)

    @property
    def committed_tokens(self) -> list[int]:
        """The tau = accept_len + 1 tokens this round commits."""
        return self.accepted_tokens + [self.bonus_token]

    @classmethod
    def from_path(cls, tree: DraftTree, accepted_nodes: list[int], bonus_token: int) -> "VerifyResult":
        tokens = tree.token_list
        return cls(list(accepted_nodes), [tokens[n] for n in accepted_nodes], int(bonus_token),
                   [d < len(accepted_nodes) for d in range(tree.max_depth)])


def _accept(coin: torch.Tensor, r_tok: torch.Tensor, q_tok: torch.Tensor) -> torch.Tensor:
    """coin < min(1, r / q), without dividing by q."""
    return coin * q_tok < r_tok


def _residual(r: torch.Tensor, q: torch.Tensor, fallback: torch.Tensor) -> torch.Tensor:
    """norm(max(0, r - q)) row-wise [B, V]; rows with no mass left take `fallback`."""
    rest = (r - q).clamp(min=0.0)
    mass = rest.sum(-1, keepdim=True)
    return torch.where(mass > _EMPTY_RESIDUAL, rest / mass.clamp(min=_EMPTY_RESIDUAL), fallback)


def _sample(probs: torch.Tensor, coins: torch.Tensor) -> torch.Tensor:
    """Inverse-CDF draw per row: probs [B, V] (need not sum to 1), coins [B] in [0, 1) -> [B] long."""
    cdf = probs.cumsum(-1)
    idx = torch.searchsorted(cdf, (coins * cdf[:, -1]).unsqueeze(1), right=True).squeeze(1)
    # rounding can push the draw past the end: clamp to the last token with mass
    last = probs.shape[1] - 1 - (probs > 0).flip(-1).int().argmax(-1)
    return torch.minimum(idx, last)


def tree_rejection_sample(
    children: torch.Tensor,  # [B, T, K] long: node i's children in sibling order, -1 padding
    tokens: torch.Tensor,  # [B, T] long
    node_offsets: torch.Tensor,  # [B] long: the row of tree b's root in target_probs / proposal_probs
    target_probs: torch.Tensor,  # [num_rows, V] processed target distribution at every node
    proposal_probs: torch.Tensor | None,  # [num_rows, V] as DraftTree.proposal_probs; None = one-hot
    coins: torch.Tensor,  # [B, T] uniform [0, 1): coin c tests node c, coin 0 draws the bonus
    max_depth: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Batched reference (the torch oracle for a rejection-sampling kernel).

    Returns accepted [B, max_depth] long (node id accepted at depth d + 1, else -1) and bonus [B] long.
    A row's residual is only spelled out ([V] work) when a candidate is rejected; until then it is
    p(node) and the accept test reads one entry of it.
    """
    batch, _, width = children.shape
    device = tokens.device
    rows = torch.arange(batch, device=device)
    node = torch.zeros(batch, dtype=torch.long, device=device)
    residual = torch.zeros(batch, target_probs.shape[1], device=device)  # [B, V], valid where ~fresh
    fresh = torch.ones(batch, dtype=torch.bool, device=device)  # residual is still p(node)
    descending = torch.ones(batch, dtype=torch.bool, device=device)
    accepted = torch.full((batch, max_depth), -1, dtype=torch.long, device=device)
    for level in range(max_depth):
        moved = torch.zeros_like(descending)
        for rank in range(width):
            child = children[rows, node, rank]
            b = (descending & ~moved & (child >= 0)).nonzero().squeeze(1)  # rows trying a candidate
            if b.numel() == 0:
                break  # children are packed first, so no row has a later sibling either
            cand, parent_row, cand_row = child[b], node_offsets[b] + node[b], node_offsets[b] + child[b]
            tok = tokens[b, cand]
            r_tok = torch.where(fresh[b], target_probs[parent_row, tok].float(), residual[b, tok])
            q_tok = torch.ones_like(r_tok) if proposal_probs is None else proposal_probs[cand_row, tok].float()
            accept = _accept(coins[b, cand], r_tok, q_tok)
            if not accept.all():
                no = ~accept
                rb, p = b[no], target_probs[parent_row[no]].float()  # p: [m, V]
                if proposal_probs is None:
                    q = torch.zeros_like(p).scatter_(1, tok[no].unsqueeze(1), 1.0)
                else:
                    q = proposal_probs[cand_row[no]].float()
                residual[rb] = _residual(torch.where(fresh[rb].unsqueeze(1), p, residual[rb]), q, p)
                fresh[rb] = False
            ab = b[accept]
            accepted[ab, level] = cand[accept]
            node[ab] = cand[accept]
            fresh[ab] = True
            moved[ab] = True
        descending &= moved
    final = torch.where(fresh.unsqueeze(1), target_probs[node_offsets + node].float(), residual)
    return accepted, _sample(final, coins[:, 0])


def verify_trees(
    trees: list[DraftTree],
    target_probs: torch.Tensor,  # [sum T_b, V] rows in tree order (build_verify_inputs order)
    generators: list[torch.Generator | None] | None = None,  # per request; None -> shared_generator
    greedy: list[bool] | None = None,  # per request; greedy rows only take the argmax of their probs
    shared_generator: torch.Generator | None = None,  # None -> torch's default generator
) -> list[VerifyResult]:
    sizes = [t.num_nodes for t in trees]
    if target_probs.shape[0] != sum(sizes):
        raise ValueError(f"target_probs has {target_probs.shape[0]} rows, the trees have {sum(sizes)} nodes")
    offsets = [0]
    for n in sizes[:-1]:
        offsets.append(offsets[-1] + n)
    greedy = greedy or [False] * len(trees)
    generators = generators or [None] * len(trees)
    results: list[VerifyResult | None] = [None] * len(trees)
    for b, tree in enumerate(trees):
        if greedy[b]:
            argmax = target_probs[offsets[b]: offsets[b] + sizes[b]].argmax(-1)
            results[b] = VerifyResult.from_path(tree, *verify_greedy(tree, argmax))
    sampled = [b for b in range(len(trees)) if not greedy[b]]
    if sampled:
        batch = [trees[b] for b in sampled]
        coins = [torch.rand(sizes[b], generator=generators[b] or shared_generator) for b in sampled]
        accepted, bonus = _verify_packed(batch, target_probs, [offsets[b] for b in sampled], coins)
        for b, tree, row, bonus_token in zip(sampled, batch, accepted.tolist(), bonus.tolist()):
            results[b] = VerifyResult.from_path(tree, [n for n in row if n >= 0], bonus_token)
    return results


def verify_tree(tree: DraftTree, target_probs: torch.Tensor, generator: torch.Generator | None = None) -> VerifyResult:
    """One sampled request: target_probs [T, V]."""
    return verify_trees([tree], target_probs, [generator])[0]


def _verify_packed(trees: list[DraftTree], target_probs: torch.Tensor, offsets: list[int],
                   coins: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Pad the small per-node tables to [B, T_max, ...] and run the batched reference."""
    device = target_probs.device
    tables = [t.children_table() for t in trees]
    batch, t_max, width = len(trees), max(t.num_nodes for t in trees), max(c.shape[1] for c in tables)
    children = torch.full((batch, t_max, width), -1, dtype=torch.long)
    tokens = torch.zeros(batch, t_max, dtype=torch.long)
    coin = torch.zeros(batch, t_max)
    for b, tree in enumerate(trees):
        n = tree.num_nodes
        children[b, :n, : tables[b].shape[1]] = tables[b].cpu()
        tokens[b, :n] = tree.tokens.cpu()
        coin[b, :n] = coins[b]
    proposal = None
    if any(t.proposal_probs is not None for t in trees):
        # rows follow target_probs' numbering; a top-k tree batched with sampled ones spells out its one-hots
        proposal = torch.zeros(target_probs.shape, device=device)
        for tree, start in zip(trees, offsets):
            n = tree.num_nodes
            if tree.proposal_probs is not None:
                proposal[start: start + n] = tree.proposal_probs.to(device)
            else:
                proposal[torch.arange(start + 1, start + n), tree.tokens[1:].cpu()] = 1.0
    return tree_rejection_sample(children.to(device), tokens.to(device), torch.tensor(offsets, device=device),
                                 target_probs, proposal, coin.to(device), max(t.max_depth for t in trees))
