"""Speculative step: one target forward over prefill chunks and draft trees, then verify and commit.

A step with speculation, per batch:
  1. The proposer drafts a tree for every request in decode (root = last committed token, which has
     no KV yet; nodes occupy consecutive scratch slots from the root's position, RoPE position =
     root position + depth).
  2. One target forward covers prefill chunks (causal) and trees (tree attention mask).
  3. Prefill items that reached their end sample one token as usual. Trees are verified: greedy
     takes the longest root path matching the target argmax; sampled requests use rejection
     sampling against the processed target distribution (specpd.verify). One bonus token follows.
  4. Commit: the accepted path's target KV moves to consecutive slots after the root (a chain's
     path already is consecutive); everything past it is scratch, and the scheduler frees whole
     surplus pages.
  5. The proposer extends over what was committed (prefill chunks and accepted paths), so its KV,
     top-k and hidden are in step with the target for the next round.
"""
from __future__ import annotations

import torch

from specpd.attention.metadata import AttentionMetadata
from specpd.core import ScheduledBatch, ScheduledItem
from specpd.draft.proposer import DraftExtend, Proposer
from specpd.kv.pool import KVPool
from specpd.kernels.kv_compact import compact_kv, compact_kv_ref, path_slot_moves
from specpd.model.runner import ModelRunner, SampledTokens
from specpd.model.sampler import SamplingRow, compute_logprobs, process_logits, sample
from specpd.verify.greedy import verify_greedy
from specpd.verify.rejection import verify_tree


class SpecRunner:
    def __init__(self, runner: ModelRunner, proposer: Proposer):
        self.runner = runner
        self.proposer = proposer

    @property
    def decode_width(self) -> int:
        """KV slots a decode round reserves past the committed length (tree nodes or draft scratch)."""
        p = self.proposer
        return max(p.num_draft_tokens, (p.num_steps - 1) * p.topk)

    def release(self, request) -> None:
        self.runner.release(request)
        self.proposer.release(request)

    @torch.inference_mode()
    def execute(self, batch: ScheduledBatch, suppress: dict[str, tuple[int, ...]]) -> list[SampledTokens]:
        runner = self.runner
        items = batch.items
        decode = [it for it in items if it.spec_decode]
        trees = dict(zip((id(it) for it in decode),
                         self.proposer.propose([it.request for it in decode], [it.start for it in decode])))
        # -- 1. one target forward over every item ------------------------------------------
        ids: list[int] = []
        positions: list[int] = []
        q_lens, masks = [], []
        for it in items:
            if it.spec_decode:
                tree = trees[id(it)]
                ids.extend(tree.tokens.tolist())
                positions.extend((it.start + tree.depth).tolist())
                q_lens.append(len(tree.tokens))
                chain = bool((tree.parents == torch.arange(-1, len(tree.tokens) - 1)).all())
                masks.append(None if chain else tree.attention_mask())  # a chain is plain causal
            else:
                ids.extend(it.request.all_token_ids[it.start:it.start + it.num_tokens])
                positions.extend(range(it.start, it.start + it.num_tokens))
                q_lens.append(it.num_tokens)
                masks.append(None)
        meta = AttentionMetadata.build(q_lens=q_lens, kv_lens=[it.start + q for it, q in zip(items, q_lens)],
                                       page_lists=[it.request.pages for it in items],
                                       page_size=runner.kv_pool.page_size, device=runner.device,
                                       tree_masks=masks)
        runner.backend.plan(meta)
        aux = self.proposer.aux_layer_ids
        hidden, captured = runner.model(torch.tensor(ids, device=runner.device),
                                        torch.tensor(positions, device=runner.device),
                                        runner.backend, meta, capture_layers=aux)
        features = torch.cat(captured, dim=-1) if aux else hidden  # what the draft consumes
        # -- 2. sample / verify ------------------------------------------------------------
        results: list[SampledTokens] = []
        extends: list[DraftExtend] = []
        offset = 0
        for it, q in zip(items, q_lens):
            rows = slice(offset, offset + q)
            offset += q
            if it.spec_decode:
                res, ext = self._verify(it, trees[id(it)], hidden[rows], features[rows], suppress)
            else:
                res, ext = self._prefill(it, hidden[rows], features[rows], suppress)
            results.append(res)
            if ext is not None:
                extends.append(ext)
        # -- 3. the proposer catches up ----------------------------------------------------
        if extends:
            self.proposer.extend(extends)
        return results

    # -- per item ---------------------------------------------------------------------------
    def _row(self, it: ScheduledItem, extra_output: list[int], suppress) -> SamplingRow:
        req = it.request
        n_out = len(req.output_token_ids) + len(extra_output)
        p = req.params
        sup = suppress.get(req.request_id, ()) if n_out < p.min_tokens else ()
        return SamplingRow(p, req.prompt_token_ids, req.output_token_ids + extra_output,
                           self.runner.generator_for(req), sup)

    def _prefill(self, it: ScheduledItem, hidden, features, suppress):
        req = it.request
        token_ids, logprobs = [], []
        if it.samples:
            row = self._row(it, [], suppress)
            logits = self.runner.model.compute_logits(hidden[-1:])
            raw = logits.clone() if row.params.logprobs is not None else None
            token = sample(process_logits(logits, [row]), [row], self.runner.shared_generator)[0]
            token_ids = [token]
            logprobs = compute_logprobs(raw, [token], [row]) if raw is not None else [None]
            nxt = token
        else:
            nxt = req.all_token_ids[it.start + it.num_tokens]
        shifted = req.all_token_ids[it.start + 1:it.start + it.num_tokens] + [nxt]
        ext = DraftExtend(req, it.start, shifted, features, at_end=it.samples)
        return SampledTokens(req.request_id, token_ids, logprobs, it.num_tokens), ext

    def _verify(self, it: ScheduledItem, tree, hidden, features, suppress):
        req = it.request
        runner = self.runner
        logits = runner.model.compute_logits(hidden)  # [T, vocab]
        want_logprobs = req.params.logprobs is not None
        raw = logits.clone() if want_logprobs else None
        if req.params.greedy and not req.params.needs_penalties and not suppress.get(req.request_id):
            path, bonus = verify_greedy(tree, logits.argmax(dim=-1))
        else:
            rows = [self._row(it, tree_path_tokens(tree, node), suppress) for node in range(len(tree.tokens))]
            probs = process_logits(logits, rows)
            result = verify_tree(tree, probs, runner.generator_for(req) or runner.shared_generator)
            path, bonus = result.accepted_nodes, result.bonus_token
        nodes = [0] + path
        tokens = [int(tree.tokens[n]) for n in path] + [bonus]
        moves = path_slot_moves(req.pages, it.start, nodes, runner.kv_pool.page_size)
        if moves[0]:  # a tree path off the first branch: move its KV next to the root
            buffer = runner.kv_pool.buffer
            compact = compact_kv if buffer.is_cuda else compact_kv_ref  # Triton on GPU, torch on CPU
            compact(buffer, *(torch.tensor(m, device=buffer.device) for m in moves))
        logprobs = [None] * len(tokens)
        if want_logprobs:
            logprobs = compute_logprobs(raw[nodes], tokens, [self._row(it, [], suppress)] * len(nodes))
        ext = DraftExtend(req, it.start, tokens, features[nodes], at_end=True)
        return SampledTokens(req.request_id, tokens, logprobs, len(nodes), num_accepted=len(path)), ext


def build_spec_runner(runner: ModelRunner, spec) -> SpecRunner:
    cfg = runner.model_config
    steps, topk, num_tokens = spec.spec_num_steps, spec.spec_topk, spec.num_draft_tokens
    if spec.speculative_algorithm == "replay":
        from specpd.draft.replay import ReplayProposer
        proposer = ReplayProposer(steps, topk, num_tokens, cfg.vocab_size)
    else:
        from specpd.draft.eagle_proposer import EagleProposer
        from specpd.draft.loader import load_draft_model
        if not spec.draft_model:
            raise ValueError(f"--speculative-algorithm {spec.speculative_algorithm} needs --draft-model")
        draft = load_draft_model(spec.draft_model, spec.speculative_algorithm, runner.model, cfg, runner.dtype)
        pool = runner.kv_pool
        shared = None  # the draft's layers inside the target's pages (the runner reserved them), else its own pool
        if pool.num_layers == cfg.num_layers + draft.config.num_layers:
            shared = KVPool.layers_of(pool, cfg.num_layers, draft.config.num_layers)
        proposer = EagleProposer(draft, pool, runner.config.attention_backend, steps, topk, num_tokens, pool=shared)
    return SpecRunner(runner, proposer)


def tree_path_tokens(tree, node: int) -> list[int]:
    """Draft tokens on the path root -> node, root excluded (the output so far at that node)."""
    toks = []
    parents = tree.parents.tolist()
    while node > 0:
        toks.append(int(tree.tokens[node]))
        node = parents[node]
    return toks[::-1]
