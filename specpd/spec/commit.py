"""The verdict on a speculative step's draft trees (runner.py, steps 3 and 4), per request.

  3. Trees are verified: greedy takes the longest root path matching the target argmax; sampled requests
     use rejection sampling against the processed target distribution (specpd.spec.verify). One bonus token
     follows. A constrained request's logits at every node are masked by its grammar first.
  4. Commit: the accepted path's target KV moves to consecutive slots after the root (a chain's
     path already is consecutive); everything past it is scratch, and the scheduler frees whole
     surplus pages.
"""
from __future__ import annotations

import torch

from specpd.core import ScheduledItem
from specpd.spec.draft.proposer import DraftExtend
from specpd.grammar.matcher import mask_tree_logits
from specpd.kernels.kv_compact import path_slot_moves
from specpd.model.runner import SampledTokens
from specpd.model.sampler import SamplingRow, compute_logprobs, greedy_tokens, process_logits
from specpd.spec.verify.greedy import verify_greedy
from specpd.spec.verify.rejection import verify_trees


class TreeVerifier:
    """SpecRunner's per-item verdicts (module docstring): the sampling row of an item, every tree's accepted
    path and bonus token, and the commit of one. It reads the runner's `runner` (the ModelRunner)."""

    def _row(self, it: ScheduledItem, extra_output: list[int], suppress) -> SamplingRow:
        req = it.request
        n_out = len(req.output_token_ids) + len(extra_output)
        p = req.params
        sup = suppress.get(req.request_id, ()) if n_out < p.min_tokens else ()
        return SamplingRow(p, req.prompt_token_ids, req.output_token_ids + extra_output,
                           self.runner.generator_for(req), sup, req.request_id)

    def _verify_all(self, tree_logits: list, suppress, batch_logits: torch.Tensor | None = None,
                    offsets: list[int] | None = None) -> list[tuple[list[int], int, torch.Tensor | None]]:
        """(accepted path, bonus token, raw logits for logprobs or None) per (item, tree, logits [T, vocab] fp32 at
        the tree's nodes): greedy trees by argmax; sampled ones in one batch (one process_logits over all their
        nodes, one verify_trees; each request's coins from its own generator, in batch order).
        batch_logits: the round's logits, of which every tree's are the row slice from offsets[j] (views, so the
        grammar masks write into it): the greedy trees' argmax is then one call over all of them (an argmax per
        tree is a call per request: in a large batch they cost as much as the verify rows of the requests that
        speculated)."""
        runner = self.runner
        out: list = [None] * len(tree_logits)
        sampled, greedy = [], []
        for j, (it, tree, logits) in enumerate(tree_logits):
            req = it.request
            if req.grammar is not None:  # every node against the target masked by the grammar state at that node
                with runner.faults.guard(req.request_id, "its grammar"):
                    mask_tree_logits(logits, req.grammar, tree.tokens, tree.parents)
            raw = logits.clone() if req.params.logprobs is not None else None
            greedy_row = req.params.greedy and not req.params.adjusts_logits and not suppress.get(req.request_id)
            (greedy if greedy_row else sampled).append(j)
            out[j] = (None, None, raw)
        if greedy and batch_logits is not None:  # one argmax over the round's rows, read at each tree's
            argmax = greedy_tokens(batch_logits)
            for j in greedy:
                tree, row = tree_logits[j][1], offsets[j]
                out[j] = (*verify_greedy(tree, argmax[row:row + tree.num_nodes]), out[j][2])
        else:
            for j in greedy:
                out[j] = (*verify_greedy(tree_logits[j][1], greedy_tokens(tree_logits[j][2])), out[j][2])
        if sampled:
            rows = [self._row(tree_logits[j][0], tree_path_tokens(tree_logits[j][1], node), suppress)
                    for j in sampled for node in range(tree_logits[j][1].num_nodes)]
            probs = process_logits(torch.cat([tree_logits[j][2] for j in sampled]), rows, runner.faults)
            gens = [runner.generator_for(tree_logits[j][0].request) or runner.shared_generator for j in sampled]
            for j, result in zip(sampled, verify_trees([tree_logits[j][1] for j in sampled], probs, gens)):
                out[j] = (result.accepted_nodes, result.bonus_token, out[j][2])
        return out

    def _commit(self, it: ScheduledItem, tree, path: list[int], bonus: int, raw, features, suppress):
        """The verdict on one tree: its accepted path's KV moved next to the root; returns the result, the draft
        extend and the accepted path."""
        req = it.request
        runner = self.runner
        nodes = [0] + path
        tokens = [tree.token_list[n] for n in path] + [bonus]
        moves = path_slot_moves(req.pages, it.start, nodes, runner.kv_pool.page_size)
        if moves[0]:  # a tree path off the first branch: move its KV next to the root (on every TP rank)
            runner.compact_kv(moves)
        logprobs = [None] * len(tokens)
        if raw is not None:
            logprobs = compute_logprobs(raw[nodes], tokens, [self._row(it, [], suppress)] * len(nodes))
        ext = DraftExtend(req, it.start, tokens, features[nodes], at_end=True)
        # a root-only tree (adaptive depth 0) was a plain decode step, not a verify: tau counts verifies only
        accepted = len(path) if tree.num_nodes > 1 else None
        return SampledTokens(req.request_id, tokens, logprobs, len(nodes), num_accepted=accepted), ext, path


def top_path_length(tree, path: list[int]) -> int:
    """How many leading nodes of the accepted `path` were each their parent's top-ranked child (the highest
    draft log-prob among its siblings): what a round drafting only the top path would have accepted."""
    parents, cum = tree.parent_list, tree.cum_list
    best: dict[int, int] = {}
    for node in range(1, len(parents)):
        p = parents[node]
        if p not in best or cum[node] > cum[best[p]]:
            best[p] = node
    n = 0
    while n < len(path) and best.get(parents[path[n]]) == path[n]:
        n += 1
    return n


def tree_path_tokens(tree, node: int) -> list[int]:
    """Draft tokens on the path root -> node, root excluded (the output so far at that node)."""
    toks = []
    parents, tokens = tree.parent_list, tree.token_list
    while node > 0:
        toks.append(tokens[node])
        node = parents[node]
    return toks[::-1]
