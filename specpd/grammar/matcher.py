"""A request's grammar state and the masks it puts on logits.

The matcher holds the state after every committed output token (the engine's `_append` advances it;
nothing else does). Masks are read from that state without changing it:
  - `mask_logits(logits, grammars)`: one row per request, the next-token mask (plain decode, prefill
    sampling y0) -- applied before penalties / temperature / top-k / top-p / min-p and before the greedy
    argmax, so every sampling path sees it;
  - `mask_tree_logits(logits, grammar, tree)`: one row per draft-tree node, the mask of the state after the
    path root..node (xgrammar walks the tree with accept / rollback in C++), so verify compares each node
    against the target distribution *masked at that node*; a draft token the grammar refuses has
    probability 0 under its parent's mask and is never accepted;
  - `mask_after(grammar, paths)`: 0 / -inf [len(paths), vocab] for the drafter, which masks its own
    proposals with it (through d2t for a reduced draft vocabulary);
  - `RequestGrammar.allowed_after(path, tokens)`: which of a few candidate tokens the grammar allows after a
    path, for the n-gram drafter, which prunes its candidates with it.
Rows for states past the end (after EOS) or past a refused token are left unmasked: nothing after them
is committed.
"""
from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass

import torch

_ALL = -1  # an int32 bitmask word with every token allowed


@dataclass
class GrammarStats:
    compiles: int = 0
    compile_cache_hits: int = 0
    compile_seconds: float = 0.0
    mask_seconds: float = 0.0  # filling and applying masks, all paths
    mask_calls: int = 0

    def as_dict(self) -> dict:
        return {"grammar_compiles": self.compiles, "grammar_compile_cache_hits": self.compile_cache_hits,
                "grammar_compile_seconds": self.compile_seconds, "grammar_mask_seconds": self.mask_seconds,
                "grammar_mask_calls": self.mask_calls}


class RequestGrammar:
    """One request's matcher (an xgrammar.GrammarMatcher over its committed output tokens)."""

    def __init__(self, matcher, vocab_size: int, stats: GrammarStats):
        self._matcher = matcher
        self.vocab_size = vocab_size
        self.stats = stats

    def accept(self, token_id: int) -> bool:
        """Advance over a committed token; False if the grammar refuses it (the state is unchanged)."""
        return self._matcher.accept_token(int(token_id))

    @property
    def terminated(self) -> bool:
        """The grammar ended and accepted EOS: nothing more may follow."""
        return self._matcher.is_terminated()

    @property
    def can_end(self) -> bool:
        """The output so far is a complete match (EOS is allowed now)."""
        return self._matcher.is_completed()

    def next_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        """Fill bitmask[row] (int32 [*, ceil(vocab / 32)]) with the next-token mask."""
        if self._matcher.is_terminated():
            bitmask[row] = _ALL
        else:
            self._matcher.fill_next_token_bitmask(bitmask, row)

    def tree_bitmask(self, tokens: torch.Tensor, parents: torch.Tensor) -> torch.Tensor:
        """int32 [T, ceil(vocab / 32)]: row i masks the token after node i (root = node 0 = now)."""
        n = tokens.shape[0]
        first_child = torch.full((n,), -1, dtype=torch.long)
        next_sibling = torch.full((n,), -1, dtype=torch.long)
        last: dict[int, int] = {}
        for node, parent in enumerate(parents.tolist()):
            if parent < 0:
                continue
            if parent in last:
                next_sibling[last[parent]] = node
            else:
                first_child[parent] = node
            last[parent] = node
        bitmask = _new_bitmask(n, self.vocab_size)
        if self._matcher.is_terminated():
            return bitmask
        self._matcher.traverse_draft_tree(first_child, next_sibling, tokens.to("cpu", torch.long), bitmask)
        _unmask_empty_rows(bitmask)
        return bitmask

    def paths_bitmask(self, paths: list[list[int]]) -> torch.Tensor:
        """int32 [len(paths), W]: row j masks the token after committed output + paths[j]."""
        bitmask = _new_bitmask(len(paths), self.vocab_size)
        m = self._matcher
        for j, path in enumerate(paths):
            accepted = 0
            for token in path:
                if m.is_terminated() or not m.accept_token(int(token)):
                    break
                accepted += 1
            if accepted == len(path) and not m.is_terminated():
                m.fill_next_token_bitmask(bitmask, j)
            if accepted:
                m.rollback(accepted)
        _unmask_empty_rows(bitmask)
        return bitmask

    def allowed_after(self, path: list[int], tokens: list[int], limit: int | None = None) -> list[bool]:
        """Which of `tokens` the grammar allows after committed output + path (all False past a refused
        token or EOS; tokens after the first `limit` allowed ones are not tried: False). A walk with accept /
        rollback that leaves the state where it was: one accept per token, no bitmask, so a model-free
        drafter can prune its candidates for a few microseconds."""
        t0 = time.perf_counter()
        m = self._matcher
        allowed = [False] * len(tokens)
        walked = 0
        for token in path:
            if m.is_terminated() or not m.accept_token(int(token)):
                break
            walked += 1
        if walked == len(path) and not m.is_terminated():
            found = 0
            for j, token in enumerate(tokens):
                if limit is not None and found == limit:
                    break
                if m.accept_token(int(token)):
                    allowed[j], found = True, found + 1
                    m.rollback(1)
        if walked:
            m.rollback(walked)
        self.stats.mask_seconds += time.perf_counter() - t0
        return allowed


def mask_logits(logits: torch.Tensor, grammars: list[RequestGrammar | None], faults=None,
                request_ids: list[str] | None = None) -> None:
    """logits [n, vocab] fp32, in place: row i gets grammars[i]'s next-token mask (None: untouched).
    faults (specpd.core.RequestFaults) with request_ids[i] per row: a matcher that fails fails its request alone."""
    rows = [i for i, g in enumerate(grammars) if g is not None]
    if not rows:
        return
    t0 = time.perf_counter()
    g0 = grammars[rows[0]]
    bitmask = _new_bitmask(logits.shape[0], g0.vocab_size)
    for i in rows:
        with faults.guard(request_ids[i], "its grammar") if faults is not None else contextlib.nullcontext():
            grammars[i].next_bitmask(bitmask, i)
    _apply(logits, bitmask, rows, g0.vocab_size)
    g0.stats.mask_seconds += time.perf_counter() - t0
    g0.stats.mask_calls += 1


def mask_tree_logits(logits: torch.Tensor, grammar: RequestGrammar, tokens: torch.Tensor,
                     parents: torch.Tensor) -> None:
    """logits [T, vocab] fp32 at a draft tree's nodes, in place (see the module docstring)."""
    t0 = time.perf_counter()
    _apply(logits, grammar.tree_bitmask(tokens, parents), None, grammar.vocab_size)
    grammar.stats.mask_seconds += time.perf_counter() - t0
    grammar.stats.mask_calls += 1


def mask_after(grammar: RequestGrammar, paths: list[list[int]]) -> torch.Tensor:
    """float32 [len(paths), vocab]: 0 where the grammar allows the token after committed output + path,
    -inf elsewhere (rows for a refused path are all 0). The drafter adds it to its own logits."""
    t0 = time.perf_counter()
    bias = torch.zeros(len(paths), grammar.vocab_size)
    _apply(bias, grammar.paths_bitmask(paths), None, grammar.vocab_size)
    grammar.stats.mask_seconds += time.perf_counter() - t0
    return bias


def _new_bitmask(rows: int, vocab_size: int) -> torch.Tensor:
    return torch.full((rows, (vocab_size + 31) // 32), _ALL, dtype=torch.int32)


def _unmask_empty_rows(bitmask: torch.Tensor) -> None:
    """Rows xgrammar zeroed (a state past EOS or a refused token) stay unmasked: nothing there is kept,
    and an all -inf row would turn into NaN probabilities."""
    empty = (bitmask == 0).all(dim=1)
    if bool(empty.any()):
        bitmask[empty] = _ALL


def _apply(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int] | None, vocab_size: int) -> None:
    import xgrammar as xgr  # only reached once a constraint exists, so xgrammar is already loaded

    xgr.apply_token_bitmask_inplace(logits, bitmask.to(logits.device), vocab_size=vocab_size, indices=rows)
