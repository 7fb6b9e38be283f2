"""Draft trees: the shape one round of speculation takes for one request.

1. The drafter makes a `TreeBuilder` rooted at the request's last committed token (the root: it is
   committed but has no KV yet, so the verify forward writes it).
2. For each of `num_steps` steps, `frontier()` names the nodes to run the draft on and `expand()`
   adds their top-k children, scored by cumulative draft log-prob (EAGLE-2).
3. `finalize()` keeps the root plus the best `num_draft_tokens - 1` nodes: a `DraftTree`.
4. `build_verify_inputs()` flattens a batch of trees for one target forward with tree attention.
5. `specpd.spec.verify.greedy` / `specpd.spec.verify.rejection` pick the accepted path (vocabulary there);
   `kv_moves()` says which scratch KV slots the commit compacts.

KV slots versus positions: node i of a tree is written at KV slot `committed_len + i` (scratch) but
rotated at position `committed_len + depth[i]`. `committed_len` counts tokens whose KV is cached, so
the root sits at position (and slot) `committed_len`.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy
import torch


class DraftTree:
    """One request's proposal tree; node order has parents before children (parents[i] < i).

    Each of tokens / parents / depth / cum_logprob is given as a tensor or a list and read either way: the
    tensor (`tokens`, ...) or the list (`token_list`, ...), each made from the other on first use and kept. A
    round reads a tree's handful of nodes as lists (its verify inputs, the greedy walk, the hybrid's merge): a
    tree built from lists never makes the tensors it is not asked for (four per tree per round, each a torch
    call's overhead for a handful of values).
    """

    _FIELDS = ("tokens", "parents", "depth", "cum_logprob")
    _DTYPES = (torch.long, torch.long, torch.long, torch.float32)

    def __init__(self, tokens: torch.Tensor | list[int], parents: torch.Tensor | list[int],
                 depth: torch.Tensor | list[int], cum_logprob: torch.Tensor | list[float],
                 proposal_probs: torch.Tensor | None = None, device: str | torch.device | None = None):
        """tokens [T] (node 0 is the root, the last committed token); parents [T] (-1 for the root); depth [T]
        (root 0); cum_logprob [T] float32, the draft log-prob of the path root..i (root 0). proposal_probs
        [T, V]: row i is the distribution token i was sampled from, given its earlier siblings (row 0 unused);
        None: deterministic (top-k) proposals, i.e. a one-hot proposal per candidate. `device`: the tensors made
        from lists (default: the device of a tensor given, else the CPU)."""
        values = (tokens, parents, depth, cum_logprob)
        self._tensor = [v if isinstance(v, torch.Tensor) else None for v in values]
        self._list = [None if isinstance(v, torch.Tensor) else list(v) for v in values]
        given = next((t for t in self._tensor if t is not None), None)
        self.device = torch.device(device) if device is not None else given.device if given is not None \
            else torch.device("cpu")
        self.proposal_probs = proposal_probs
        n = len(self._list[0]) if self._list[0] is not None else tokens.shape[0]
        for i, name in enumerate(self._FIELDS[1:], 1):
            shape = tuple(self._tensor[i].shape) if self._tensor[i] is not None else (len(self._list[i]),)
            if shape != (n,):
                raise ValueError(f"DraftTree.{name} must have shape [{n}], got {shape}")
        if self.proposal_probs is not None and self.proposal_probs.shape[0] != n:
            raise ValueError(f"DraftTree.proposal_probs must have {n} rows, got {self.proposal_probs.shape[0]}")
        self._n = n

    def _as_tensor(self, i: int) -> torch.Tensor:
        if self._tensor[i] is None:
            self._tensor[i] = torch.tensor(self._list[i], dtype=self._DTYPES[i], device=self.device)
        return self._tensor[i]

    def _as_list(self, i: int) -> list:
        if self._list[i] is None:
            self._list[i] = self._tensor[i].tolist()
        return self._list[i]

    tokens = property(lambda self: self._as_tensor(0), doc="[T] long")
    parents = property(lambda self: self._as_tensor(1), doc="[T] long; -1 for the root")
    depth = property(lambda self: self._as_tensor(2), doc="[T] long; root 0")
    cum_logprob = property(lambda self: self._as_tensor(3), doc="[T] float32")
    token_list = property(lambda self: self._as_list(0), doc="`tokens` as a list (not to be changed)")
    parent_list = property(lambda self: self._as_list(1), doc="`parents` as a list (not to be changed)")
    depth_list = property(lambda self: self._as_list(2), doc="`depth` as a list (not to be changed)")
    cum_list = property(lambda self: self._as_list(3), doc="`cum_logprob` as a list of float32 values")

    def __repr__(self) -> str:
        return (f"DraftTree(tokens={self.token_list}, parents={self.parent_list}, depth={self.depth_list}, "
                f"cum_logprob={self.cum_list}, proposal_probs={self.proposal_probs is not None})")

    @classmethod
    def chain(cls, root_token: int, draft_tokens: list[int] | torch.Tensor,
              draft_logprobs: torch.Tensor | None = None,
              proposal_probs: torch.Tensor | None = None) -> "DraftTree":
        """A chain root -> d_1 -> ... -> d_n. proposal_probs [n, V] are the distributions d_i were
        sampled from (no root row); draft_logprobs [n] are per-token draft log-probs."""
        drafts = torch.as_tensor(draft_tokens, dtype=torch.long).reshape(-1)
        n = drafts.shape[0]
        device = drafts.device
        cum = torch.zeros(n + 1, device=device)
        if draft_logprobs is not None:
            cum[1:] = draft_logprobs.float().to(device).cumsum(0)
        if proposal_probs is not None:
            proposal_probs = torch.cat([proposal_probs.new_zeros(1, proposal_probs.shape[1]), proposal_probs])
        return cls(
            tokens=torch.cat([torch.tensor([root_token], device=device), drafts]),
            parents=torch.arange(-1, n, device=device),
            depth=torch.arange(n + 1, device=device),
            cum_logprob=cum,
            proposal_probs=proposal_probs,
        )

    @property
    def num_nodes(self) -> int:
        return self._n

    @property
    def max_depth(self) -> int:
        return max(self.depth_list)

    def path_to(self, node: int) -> list[int]:
        """Node ids root..node."""
        parents = self.parent_list
        path = [node]
        while parents[path[-1]] >= 0:
            path.append(parents[path[-1]])
        return path[::-1]

    def children(self, node: int) -> list[int]:
        """Child ids in sibling order (the order the verifier tries them)."""
        return (self.parents == node).nonzero().flatten().tolist()

    def children_table(self, width: int | None = None) -> torch.Tensor:
        """[T, width] long: row i lists i's children in sibling order, padded with -1."""
        n = self.num_nodes
        child = torch.arange(1, n, device=self.tokens.device)
        order = torch.sort(self.parents[1:], stable=True).indices
        par_sorted = self.parents[1:][order]
        # rank among siblings = position in the sorted run of equal parents
        rank = torch.arange(n - 1, device=child.device) - torch.searchsorted(par_sorted, par_sorted)
        width = int(rank.max()) + 1 if width is None and n > 1 else (width or 1)
        table = torch.full((n, width), -1, dtype=torch.long, device=child.device)
        table[par_sorted, rank] = child[order]
        return table

    def attention_mask(self) -> torch.Tensor:
        """[T, T] bool: node i attends to node j iff j is an ancestor of i or i itself."""
        # in Python, one tensor at the end: a tree has a handful of nodes, and a torch op per depth level cost more
        # than the whole walk
        parents = self.parent_list
        rows = []
        for i, parent in enumerate(parents):
            row = rows[parent][:] if parent >= 0 else [False] * len(parents)  # parents come before children
            row[i] = True
            rows.append(row)
        return torch.tensor(rows, dtype=torch.bool, device=self.device).reshape(len(parents), len(parents))

    def kv_mask(self, committed_len: int) -> torch.Tensor:
        """[T, committed_len + T] bool: the whole cached prefix, then the tree mask over the scratch slots."""
        prefix = torch.ones(self.num_nodes, committed_len, dtype=torch.bool, device=self.device)
        return torch.cat([prefix, self.attention_mask()], dim=1)

    def positions(self, start: int) -> torch.Tensor:
        """[T] long rotary positions: start (= committed_len) + depth."""
        return start + self.depth


def root_only(root_token: int) -> DraftTree:
    """A tree with no proposals: its verify is a plain decode step (adaptive speculation's depth 0)."""
    return DraftTree([int(root_token)], [-1], [0], [0.0])


def kv_moves(accepted_nodes: list[int]) -> list[tuple[int, int]]:
    """(src, dst) KV slot offsets from committed_len that put the accepted path in consecutive slots
    after the root. Applying them in order is safe: src >= dst, and every later src is larger."""
    return [(node, k + 1) for k, node in enumerate(accepted_nodes) if node != k + 1]


def best_ids(score: list[float], ids: range, n: int) -> list[int]:
    """The best `n` of `ids` (ascending) by (score desc, id asc), in ascending order: how draft trees are pruned
    (TreeBuilder's frontiers and trees, the hybrid's merged trie). Scores never rise from parent to child and a
    parent has the smaller id, so the kept set is ancestor-closed."""
    return sorted(sorted(ids, key=lambda i: -score[i])[:n])


def draft_logp(probs: torch.Tensor) -> list:
    """Draft probabilities [F, K] -> the scores a tree adds up, as lists: their float32 logs, log 0 (or NaN) as
    float32's lowest (two of them add up to -inf), never above 0 (a child never outscores its parent: pruning
    relies on it)."""
    return torch.log(probs.float()).nan_to_num(nan=float("-inf")).clamp(max=0.0).tolist()


class TreeBuilder:
    """EAGLE-2 tree growth for one request (SGLang's select_top_k_tokens + organize_draft_results).

    Step 0 expands the root with its top-k; step s >= 1 expands the best `topk` of step s-1's new
    candidates, each with its top-k. Every candidate ever created competes in `finalize()`.
    Pool size: 1 + topk + (num_steps - 1) * topk**2 nodes, numbered in creation order.

    The pool is Python lists (a tree has a handful of nodes, so a torch op on them is all call overhead, and at
    batch 1 the builders' ops were a real share of the round); scores are float32 as before (the log in torch,
    the sums rounded to float32), so frontiers and trees are the torch builder's (tests/spec/tree_reference.py).
    Tensors are made at `finalize` and by the views below.
    """

    def __init__(self, root_token: int, topk: int, num_steps: int, num_draft_tokens: int,
                 device: str | torch.device = "cpu"):
        if topk < 1 or num_steps < 1 or num_draft_tokens < 2:
            raise ValueError(f"need topk >= 1, num_steps >= 1, num_draft_tokens >= 2; got "
                             f"topk={topk}, num_steps={num_steps}, num_draft_tokens={num_draft_tokens}")
        self.topk, self.num_steps, self.num_draft_tokens = topk, num_steps, num_draft_tokens
        self.device = torch.device(device)
        self.token_ids: list[int] = [int(root_token)]
        self.parent_ids: list[int] = [-1]
        self._depth: list[int] = [0]
        self._cum: list[float] = [0.0]  # float32 values
        self._proposals: list[torch.Tensor] | None = None  # per step [F * K, V] (chains only)
        self._last = (0, 1)  # node id range created by the last expand (the root before step 0)
        self.steps_done = 0

    @property
    def num_nodes(self) -> int:
        return len(self.token_ids)

    @property
    def done(self) -> bool:
        return self.steps_done == self.num_steps

    # Views of the pool in creation order, as tensors (the drafter reads token_ids / parent_ids).
    @property
    def tokens(self) -> torch.Tensor:  # [N] long
        return torch.tensor(self.token_ids, dtype=torch.long, device=self.device)

    @property
    def parents(self) -> torch.Tensor:  # [N] long
        return torch.tensor(self.parent_ids, dtype=torch.long, device=self.device)

    @property
    def depth(self) -> torch.Tensor:  # [N] long
        return torch.tensor(self._depth, dtype=torch.long, device=self.device)

    @property
    def cum_logprob(self) -> torch.Tensor:  # [N] float
        return torch.tensor(self._cum, dtype=torch.float32, device=self.device)

    def _best(self, ids: range, n: int) -> list[int]:
        """The best `n` of `ids` by (cum_logprob desc, id asc), ascending: the one ranking frontiers and trees use."""
        return best_ids(self._cum, ids, n)

    def frontier_ids(self) -> list[int]:
        """Pool ids to expand this step, ascending: the root at step 0, later the best `topk` of the last step's
        new nodes by (cum_logprob desc, id asc)."""
        if self.done:
            raise RuntimeError(f"all {self.num_steps} draft steps are done")
        return self._best(range(*self._last), self.topk)

    def frontier(self) -> torch.Tensor:
        """[F] long: `frontier_ids`."""
        return torch.tensor(self.frontier_ids(), dtype=torch.long, device=self.device)

    def expand_ids(self, topk_ids: torch.Tensor | list, topk_probs: torch.Tensor,
                   proposal_probs: torch.Tensor | None = None) -> range:
        """Add K children per frontier node, in frontier order then rank order.

        topk_ids [F, K] long (or nested lists), topk_probs [F, K] draft probs (only scores). proposal_probs
        [F, K, V]: the distribution each child was sampled from; allowed for chains (topk == 1) only, because
        keeping sampled candidates by their score biases them away from that distribution.
        Returns the new pool ids (F * K of them).
        """
        f, k = len(self.frontier_ids()), self.topk
        if tuple(topk_probs.shape) != (f, k):
            raise ValueError(f"expand expects topk_probs of shape [{f}, {k}], got {tuple(topk_probs.shape)}")
        if proposal_probs is not None and k != 1:
            raise ValueError("sampled proposals need topk == 1: tree pruning by draft score is not lossless for them")
        if (proposal_probs is None) != (self._proposals is None) and self.steps_done > 0:
            raise ValueError("proposal_probs must be given at every step or at none")
        new = self._add(topk_ids.tolist() if isinstance(topk_ids, torch.Tensor) else topk_ids, draft_logp(topk_probs))
        if proposal_probs is not None:
            self._proposals = (self._proposals or []) + [proposal_probs.to(self.device).reshape(f * k, -1)]
        return new

    def expand_logp(self, topk_ids: list[list[int]], logp: list[list[float]]) -> range:
        """`expand_ids` from lists: topk_ids [F][K] and their scores `draft_logp(topk_probs)` [F][K] (a drafter
        converts a whole level's top-k at once and hands each request its rows)."""
        if self._proposals is not None:
            raise ValueError("proposal_probs must be given at every step or at none")
        return self._add(topk_ids, logp)

    def _add(self, topk_ids: list[list[int]], logp: list[list[float]]) -> range:
        frontier = self.frontier_ids()
        f, k = len(frontier), self.topk
        shape = (len(topk_ids), *{len(r) if isinstance(r, (list, tuple)) else -1 for r in topk_ids})
        scores = (len(logp), *{len(r) for r in logp})
        if shape != (f, k) or scores != (f, k):
            raise ValueError(f"expand expects topk_ids / scores of shape [{f}, {k}], got {shape} / {scores}")
        start = len(self.token_ids)
        depth = self.steps_done + 1
        with numpy.errstate(over="ignore"):  # (log 0 is scored float32's lowest: two of them add up to -inf)
            for node, row_ids, row_logp in zip(frontier, topk_ids, logp):
                base = numpy.float32(self._cum[node])
                for token, lp in zip(row_ids, row_logp):
                    self.token_ids.append(int(token))
                    self.parent_ids.append(node)
                    self._depth.append(depth)
                    self._cum.append(float(base + numpy.float32(lp)))  # float32 addition, as the torch builder's
        end = len(self.token_ids)
        self._last = (start, end)
        self.steps_done += 1
        return range(start, end)

    def expand(self, topk_ids: torch.Tensor, topk_probs: torch.Tensor,
               proposal_probs: torch.Tensor | None = None) -> torch.Tensor:
        """`expand_ids`, the new pool ids as a [F * K] long tensor."""
        new = self.expand_ids(topk_ids, topk_probs, proposal_probs)
        return torch.arange(new.start, new.stop, device=self.device)

    def finalize(self) -> DraftTree:
        """The root plus the best T-1 nodes (T = min(num_draft_tokens, pool size)) by
        (cum_logprob desc, id asc), renumbered in creation order.

        Ancestor-closed even under ties: a parent has a smaller id and cum_logprob >= its child's,
        so it always ranks before the child.
        """
        n = len(self.token_ids)
        t = min(self.num_draft_tokens, n)
        cum = self._cum
        keep = [0] + self._best(range(1, n), t - 1)
        new_id = {old: new for new, old in enumerate(keep)}
        parents = [-1] + [new_id[self.parent_ids[i]] for i in keep[1:]]
        proposal = None
        if self._proposals is not None:
            rows = torch.cat(self._proposals)
            proposal = torch.cat([rows.new_zeros(1, rows.shape[1]), rows])[torch.tensor(keep, device=rows.device)]
        return DraftTree([self.token_ids[i] for i in keep], parents, [self._depth[i] for i in keep],
                         [cum[i] for i in keep], proposal, device=self.device)


@dataclass
class TreeVerifyInputs:
    """One target forward over a batch of trees; each tree's nodes are queries after its prefix."""

    input_ids: torch.Tensor  # [num_tokens] long, the trees' tokens concatenated
    positions: torch.Tensor  # [num_tokens] long, committed_len + depth
    qo_indptr: torch.Tensor  # [batch + 1] long, offsets of each tree in the flat arrays
    tree_masks: list[torch.Tensor]  # per request [T_b, T_b] bool, True = attend
    q_lens: list[int]  # T_b
    kv_lens: list[int]  # committed_len_b + T_b (node i's KV goes to slot committed_len_b + i)


def build_verify_inputs(trees: list[DraftTree], committed_lens: list[int]) -> TreeVerifyInputs:
    if len(trees) != len(committed_lens):
        raise ValueError(f"{len(trees)} trees but {len(committed_lens)} committed_lens")
    q_lens = [t.num_nodes for t in trees]
    indptr = torch.tensor([0] + q_lens).cumsum(0)
    return TreeVerifyInputs(
        input_ids=torch.cat([t.tokens for t in trees]),
        positions=torch.cat([t.positions(c) for t, c in zip(trees, committed_lens)]),
        qo_indptr=indptr.to(trees[0].tokens.device),
        tree_masks=[t.attention_mask() for t in trees],
        q_lens=q_lens,
        kv_lens=[c + q for c, q in zip(committed_lens, q_lens)],
    )
