"""N-gram (suffix) drafting: training-free proposals from text the request has already seen.

The idea behind prompt lookup and suffix decoding: when the last few tokens occurred before — in the
prompt, in the output so far, or in a recent request's output — what followed them then is a good
guess for what follows now. No draft model, no hidden states, no draft KV.

Per request, and in one bounded store shared across requests:
  1. `SuffixCounts` keeps, for every context of 1..max_match tokens seen in a token stream, how often
     each next token followed it (and which came last). Appending a token updates max_match entries:
     the index is incremental, never a rescan of the context.
  2. To draft from a node of the tree, the longest context (max_match down to min_match tokens) of
     committed tokens + the draft path to that node that occurred before gives the candidate next
     tokens, ranked by count, then recency. A candidate's estimated acceptance is count / (total + 1):
     one earlier occurrence is a coin flip, a continuation seen every time is near certain.
  3. `NgramProposer.propose` grows each request's tree best-first by estimated path acceptance
     (product along the path): at most `topk` children per node, `num_steps` levels,
     `num_draft_tokens` nodes (root included). Scores never rise along a path, so the kept set is
     ancestor-closed. A request with no match gets a root-only tree: a plain decode step.
  4. When a request finishes its output enters the shared store (`NgramStore`), which forgets its
     oldest sequences past `max_tokens` (the memory bound).
Proposals are deterministic (one-hot q), so verify stays lossless however the tree is pruned. A request
with a grammar (structured output) drafts only tokens its grammar allows along the path: a walk with the
matcher per expanded node, rolled back (verify masks the target anyway; this keeps refused tokens from
taking the tree's slots).
"""
from __future__ import annotations

import heapq
from collections import deque

import torch

from specpd.core import Request
from specpd.spec.draft.proposer import DraftExtend, Proposer
from specpd.spec.tree import DraftTree

Context = tuple[int, ...]


class SuffixCounts:
    """Next-token counts after every context of 1..max_match tokens of appended token streams."""

    def __init__(self, max_match: int):
        if max_match < 1:
            raise ValueError(f"max_match must be >= 1, got {max_match}")
        self.max_match = max_match
        # context -> {next token: count}; dict order is recency (a token re-counted moves to the end)
        self.table: dict[Context, dict[int, int]] = {}

    def __len__(self) -> int:
        return len(self.table)

    def add(self, tokens: list[int], start: int = 0, delta: int = 1) -> None:
        """Count tokens[i] after each of its contexts, for i >= start (earlier tokens are context)."""
        table, m = self.table, self.max_match
        for i in range(max(start, 1), len(tokens)):
            nxt = tokens[i]
            for n in range(1, min(m, i) + 1):
                ctx = tuple(tokens[i - n:i])
                counts = table.get(ctx)
                if counts is None:
                    if delta < 0:
                        continue
                    counts = table[ctx] = {}
                c = counts.pop(nxt, 0) + delta
                if c > 0:
                    counts[nxt] = c
                elif not counts:
                    del table[ctx]

    def lookup(self, tail: list[int], min_match: int) -> tuple[int, dict[int, int] | None]:
        """(match length, next-token counts) for the longest suffix of `tail` seen as a context."""
        for n in range(min(self.max_match, len(tail)), min_match - 1, -1):
            counts = self.table.get(tuple(tail[-n:]))
            if counts:
                return n, counts
        return 0, None


class NgramStore:
    """Recent requests' outputs shared across requests, bounded to `max_tokens` indexed tokens."""

    def __init__(self, max_tokens: int, max_match: int):
        self.max_tokens = max_tokens
        self.counts = SuffixCounts(max_match)
        self._sequences: deque[tuple[list[int], int]] = deque()  # (tokens, first counted index)
        self.num_tokens = 0

    def add(self, context: list[int], output: list[int]) -> None:
        """Index `output`, with up to max_match tokens of `context` before it (context is not counted)."""
        if self.max_tokens <= 0 or not output:
            return
        output = output[-self.max_tokens:]
        lead = context[-self.counts.max_match:] if context else []
        seq = lead + output
        self.counts.add(seq, start=len(lead))
        self._sequences.append((seq, len(lead)))
        self.num_tokens += len(output)
        while self.num_tokens > self.max_tokens:
            old, first = self._sequences.popleft()
            self.counts.add(old, start=first, delta=-1)
            self.num_tokens -= len(old) - first


class _RequestIndex:
    __slots__ = ("counts", "indexed")

    def __init__(self, max_match: int):
        self.counts = SuffixCounts(max_match)
        self.indexed = 0  # tokens of all_token_ids counted so far


class NgramProposer(Proposer):
    """Model-free drafter over each request's tokens and a shared store of recent outputs."""

    def __init__(self, num_steps: int, topk: int, num_draft_tokens: int, min_match: int = 2,
                 max_match: int = 8, store_tokens: int = 1 << 16):
        super().__init__(num_steps, topk, num_draft_tokens)
        if not 1 <= min_match <= max_match:
            raise ValueError(f"need 1 <= spec_ngram_min_match <= spec_ngram_max_match, got {min_match}, {max_match}")
        self.min_match, self.max_match = min_match, max_match
        self.store = NgramStore(store_tokens, max_match)
        self._index: dict[str, _RequestIndex] = {}

    @property
    def model_free(self) -> bool:
        return True

    @property
    def scratch_width(self) -> int:
        return 0

    def extend(self, extends: list[DraftExtend]) -> None:
        pass  # the index follows request.all_token_ids lazily in propose()

    def release(self, request: Request) -> None:
        if self._index.pop(request.request_id, None) is not None:
            self.store.add(request.prompt_token_ids, request.output_token_ids)
        request.spec_state = None

    def _sync(self, req: Request) -> list[int]:
        idx = self._index.get(req.request_id)
        if idx is None:
            idx = self._index[req.request_id] = _RequestIndex(self.max_match)
        tokens = req.all_token_ids
        if idx.indexed < len(tokens):
            idx.counts.add(tokens, start=max(1, idx.indexed))
            idx.indexed = len(tokens)
        return tokens

    def candidates(self, req: Request, tail: list[int], path: list[int] | None = None) -> list[tuple[int, float]]:
        """[(token, estimated acceptance)] best first, at most topk, for the token after `tail`. With a
        grammar, `path` is the draft path from the root: candidates the grammar refuses after it are dropped
        before the topk cut (verify would reject them; a lower-ranked allowed token takes the slot)."""
        own_n, own = self._index[req.request_id].counts.lookup(tail, self.min_match)
        shared_n, shared = self.store.counts.lookup(tail, self.min_match)
        counts = own if own_n >= shared_n else shared
        if not counts:
            return []
        total = sum(counts.values())
        order = list(counts.items())  # recency order: later = more recent
        ranked = sorted(range(len(order)), key=lambda i: (order[i][1], i), reverse=True)
        if req.grammar is not None:
            allowed = req.grammar.allowed_after(path or [], [order[i][0] for i in ranked], limit=self.topk)
            ranked = [i for i, ok in zip(ranked, allowed) if ok]
        return [(order[i][0], order[i][1] / (total + 1)) for i in ranked[: self.topk]]

    def first_guesses(self, req: Request, width: int) -> list[int]:
        """The tokens a depth-1 round would propose for the request's next token now, best first (at most
        `width`; none without a match): a shadow probe's guess (spec_runner), a lookup that costs microseconds."""
        tokens = self._sync(req)
        return [token for token, _ in self.candidates(req, tokens[-self.max_match:])][:width]

    def propose(self, requests: list[Request], starts: list[int], plans=None) -> list[DraftTree]:
        trees = []
        for i, req in enumerate(requests):
            steps, budget = (self.num_steps, self.num_draft_tokens) if plans is None else plans[i]
            trees.append(self.tree_for(req, steps, budget))
        return trees

    def tree_for(self, req: Request, num_steps: int, num_draft_tokens: int) -> DraftTree:
        tokens = self._sync(req)
        root_tail = tokens[-self.max_match:]
        node_tokens, parents, depths, scores = [tokens[-1]], [-1], [0], [1.0]
        paths: list[list[int]] = [[]]
        heap: list[tuple[float, int, int, int, int]] = []  # (-score, tie, parent, token, depth)
        tie = 0

        def push_children(node: int) -> None:
            nonlocal tie
            if depths[node] >= num_steps:
                return
            tail = (root_tail + paths[node])[-self.max_match:]
            for token, p in self.candidates(req, tail, paths[node]):
                heapq.heappush(heap, (-scores[node] * p, tie, node, token, depths[node] + 1))
                tie += 1

        if num_steps > 0:
            push_children(0)
        while heap and len(node_tokens) < num_draft_tokens:
            neg, _, parent, token, depth = heapq.heappop(heap)
            node_tokens.append(token)
            parents.append(parent)
            depths.append(depth)
            scores.append(-neg)
            paths.append(paths[parent] + [token])
            push_children(len(node_tokens) - 1)
        return DraftTree(node_tokens, parents, depths, torch.log(torch.tensor(scores)))
