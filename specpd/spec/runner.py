"""Speculative step: one target forward over prefill chunks and draft trees, then verify and commit.

A step with speculation, per batch:
  1. The proposer drafts a tree for every request in decode (root = last committed token, which has
     no KV yet; nodes occupy consecutive scratch slots from the root's position, RoPE position =
     root position + depth).
  2. One target forward covers prefill chunks (causal) and trees (tree attention mask).
  3. Prefill items that reached their end sample one token as usual. Trees are verified (greedy or
     rejection sampling) and one bonus token follows (commit.py).
  4. Commit: the accepted path's target KV moves next to the root; the rest is scratch (commit.py).
  5. The proposer extends over what was committed (prefill chunks and accepted paths), so its KV,
     top-k and hidden are in step with the target for the next round.
"""
from __future__ import annotations

import time

import torch

from specpd.core import ScheduledBatch, ScheduledItem
from specpd.spec.draft.eagle_proposer import EagleProposer
from specpd.spec.draft.hybrid import HybridProposer
from specpd.spec.draft.ngram import NgramProposer
from specpd.spec.draft.proposer import DraftExtend, Proposer
from specpd.grammar.matcher import mask_logits
from specpd.model.runner import ModelRunner, SampledTokens, StepRunner
from specpd.model.sampler import compute_logprobs, process_logits, sample
from specpd.spec.calibration import calibrate
from specpd.spec.cost import CostModel
from specpd.spec.defer import DeferredExtends
from specpd.spec.policy import AdaptivePolicy
from specpd.spec.commit import TreeVerifier, top_path_length


class SpecRunner(TreeVerifier, DeferredExtends, StepRunner):
    def __init__(self, runner: ModelRunner, proposer: Proposer, policy: AdaptivePolicy | None = None):
        self.runner = runner
        self.proposer = proposer
        self.policy = policy  # None: every request drafts the proposer's full shape every round
        DeferredExtends.__init__(self)
        # the last decode round, read when the next one starts (`_observe_cycle`): (start, requests, speculated,
        # seconds of its execute)
        self._last_round: tuple[float, int, bool, float] | None = None
        # an n-gram drafter's shadow probes: each probing request's depth-1 guesses, looked up before the round
        # commits its token (a draft model's are its caught-up draft state's top-k)
        self._guesses: dict[str, list[int]] = {}
        # a hybrid's free probes: requests at depth 0 whose n-gram half has a guess, probed on it alone (their
        # draft not caught up) in a round the policy did not shadow-probe them in (`_free_guesses`)
        self._free: set[str] = set()

    @property
    def decode_width(self) -> int:
        """KV slots a decode round reserves past the committed length (tree nodes or draft scratch)."""
        p = self.proposer
        return max(p.num_draft_tokens, p.scratch_width)

    def release(self, request) -> None:
        self.runner.release(request)
        self.proposer.release(request)
        self._drop_deferred(request.request_id)
        if self.policy is not None:
            self.policy.release(request.request_id)

    @torch.inference_mode()
    def execute(self, batch: ScheduledBatch, suppress: dict[str, tuple[int, ...]]) -> list[SampledTokens]:
        policy = self.policy
        items = batch.items
        decode = [it for it in items if it.spec_decode]
        requests = [it.request for it in decode]
        plans, shadow, prompt_catch_up, catch_s = None, set(), False, 0.0
        t_round = time.perf_counter()
        self._observe_cycle(t_round)
        draft_s = 0.0  # the round's draft work (catch-up, proposal, extend): CostModel.observe_round splits by it
        if policy is not None and decode:
            others = [it for it in items if not it.spec_decode]
            pending = [self._pending.get(r.request_id, 0) for r in requests]
            plans = policy.plan([r.request_id for r in requests], len(others), sum(it.num_tokens for it in others),
                                pending, [self._prompt_pending.get(r.request_id, 0) for r in requests])
            shadow = set(policy.shadow_probes)  # at depth 0, their drafts caught up: a shadow probe each
            if shadow and isinstance(self.proposer, NgramProposer):
                self._guesses = {r.request_id: self.proposer.first_guesses(r, policy.rows(1) - 1)
                                 for r in requests if r.request_id in shadow}
            elif isinstance(self.proposer, HybridProposer):
                self._free_guesses(requests, plans, shadow)
            catching = [r for r, (steps, _) in zip(requests, plans) if steps > 0 or r.request_id in shadow]
            # a prompt's deferred extend (unpriced) in the catch-up: work the eager extend did at prefill, not what
            # this round's speculation costs, so the round is not read (observe_round, observe_round_time)
            prompt_catch_up = any(self._prompt_pending.get(r.request_id) for r in catching)
            t0 = time.perf_counter()
            caught = self._catch_up(catching)
            draft_s = catch_s = time.perf_counter() - t0
            if caught:
                policy.cost.observe_extend(caught, catch_s)  # one extend call (CostModel.extend_scale)
            if not any(steps for steps, _ in plans):
                return self._plain_round(batch, suppress, t_round, shadow)
        t0 = time.perf_counter()
        trees = dict(zip((id(it) for it in decode),
                         self.proposer.propose(requests, [it.start for it in decode], plans)))
        draft_s += time.perf_counter() - t0
        # -- 1. one target forward over every item ------------------------------------------
        ids: list[int] = []
        positions: list[int] = []
        q_lens, masks = [], []
        for it in items:
            if it.spec_decode:
                tree = trees[id(it)]
                ids.extend(tree.token_list)
                positions.extend(it.start + d for d in tree.depth_list)
                q_lens.append(tree.num_nodes)
                chain = tree.parent_list == list(range(-1, tree.num_nodes - 1))
                masks.append(None if chain else tree.attention_mask())  # a chain is plain causal
            else:
                ids.extend(it.request.all_token_ids[it.start:it.start + it.num_tokens])
                positions.extend(range(it.start, it.start + it.num_tokens))
                q_lens.append(it.num_tokens)
                masks.append(None)
        # rows whose logits are needed: every tree node, the last row of a prefill item that samples
        logit_rows, offset = [], 0
        for it, q in zip(items, q_lens):
            if it.spec_decode:
                logit_rows.extend(range(offset, offset + q))
            elif it.samples:
                logit_rows.append(offset + q - 1)
            offset += q
        t0 = time.perf_counter()
        hidden, features, logits = self._target_forward(ids, positions, q_lens,
                                                        [it.start + q for it, q in zip(items, q_lens)],
                                                        [it.request.pages for it in items], masks, logit_rows)
        target_s = time.perf_counter() - t0
        if policy is not None and len(decode) == len(items):  # a prefill chunk's rows are not a round's
            policy.cost.observe_target(len(items), len(ids), target_s)
        # -- 2. sample / verify ------------------------------------------------------------
        item_logits, item_rows, row = [], [], 0  # per item: a tree's nodes' logits (a view of `logits` from
        for it, q in zip(items, q_lens):  # item_rows), a sampling prefill's last row's, or None
            n = q if it.spec_decode else int(it.samples)
            item_logits.append(logits[row:row + n] if n else None)
            item_rows.append(row)
            row += n
        verify = [j for j, it in enumerate(items) if it.spec_decode]
        verdicts = iter(self._verify_all([(items[j], trees[id(items[j])], item_logits[j]) for j in verify], suppress,
                                         logits, [item_rows[j] for j in verify]))
        results: list[SampledTokens] = []
        extends: list[DraftExtend] = []
        offset = 0
        for it, q, lg in zip(items, q_lens, item_logits):
            rows = slice(offset, offset + q)
            offset += q
            if it.spec_decode:
                tree = trees[id(it)]
                res, ext, path = self._commit(it, tree, *next(verdicts), features[rows], suppress)
                if policy is not None:
                    if it.request.request_id in shadow or it.request.request_id in self._free:
                        self._observe_shadow(it.request, res.token_ids, caught_up=it.request.request_id in shadow)
                    else:  # what the top path kept: only a policy that offers narrow rounds reads it
                        top_path = top_path_length(tree, path) if policy.narrow_ok else None
                        policy.observe(it.request.request_id, tree.max_depth, res.num_accepted or 0, top_path)
                    policy.stats.record(tree.num_nodes - 1, off=tree.num_nodes == 1)
                    if self.proposer.needs_hidden:  # run when the request speculates next
                        self._defer(ext)
                        ext = None
            else:
                res, ext = self._prefill(it, lg, features[rows], suppress)
                ext = self._prompt_extend_now(ext, it)
            results.append(res)
            if ext is not None:
                extends.append(ext)
        # -- 3. the proposer catches up ----------------------------------------------------
        if extends:
            t0 = time.perf_counter()
            self.proposer.extend(extends)
            draft_s += time.perf_counter() - t0
        # a prefill's extend is not the draft's round cost, nor a draft model's shadow-probe catch-up a depth-0
        # round's (an n-gram's probe is a lookup: its rounds are read, else a model-free server at b8 read none)
        if plans is not None and len(decode) == len(items) and not self._costly(shadow) and not prompt_catch_up:
            speculating = sum(1 for steps, _ in plans if steps > 0)
            policy.cost.observe_round(len(decode), time.perf_counter() - t_round - target_s, speculating > 0,
                                      policy.last_draft_s, speculating,
                                      draft_s=draft_s if not self.proposer.model_free else None,
                                      predicted_extend_s=policy.last_extend_s, extend_s=catch_s)
            self._last_round = (t_round, len(decode), speculating > 0, time.perf_counter() - t_round)
        return results

    def _costly(self, shadow: set) -> bool:
        """Whether this round's shadow probes cost work of their own: a draft model's catch-up extend does, an
        n-gram drafter's guesses (a lookup made before the round) do not."""
        return bool(shadow) and not self.proposer.model_free

    def _observe_cycle(self, now: float) -> None:
        """The last decode round's whole cycle, its start to this round's (its postprocess, streaming, the
        scheduler, and the HTTP thread's share of the GIL included: what a client waits for), to the policy
        (AdaptivePolicy.observe_round_time). A cycle over twice its execute was an idle engine, not a cost."""
        last, self._last_round = self._last_round, None
        if last is None or self.policy is None:
            return
        start, requests, speculated, execute_s = last
        if now - start <= 2 * execute_s:
            self.policy.observe_round_time(requests, now - start, speculated)

    def _free_guesses(self, requests, plans, shadow: set) -> None:
        """A hybrid's n-gram guesses for its requests at depth 0 (a lookup: free). Each one with a guess probes on
        it this round, its draft not caught up (`_free`); one the policy shadow-probes offers them beside its
        draft's top-k. Probed through its draft alone, a hybrid server whose head guesses poorly sat at depth 0
        on grounded text its n-gram half would nearly always have drafted (evals/results/peers_spec.json)."""
        width = self.policy.rows(1) - 1
        self._guesses, self._free = {}, set()
        for r, (steps, _) in zip(requests, plans):
            if steps == 0:
                guesses = self.proposer.ngram.first_guesses(r, width)
                if guesses:
                    self._guesses[r.request_id] = guesses
                    if r.request_id not in shadow:
                        self._free.add(r.request_id)

    def _observe_shadow(self, request, committed: list[int], caught_up: bool = True) -> None:
        """A shadow probe's outcome (AdaptivePolicy.shadow): the draft, caught up before this round, proposed
        its top-k for the token the round committed. A full-width round's tree keeps any of its first level
        (up to min(K, T - 1) of the top-k), a narrow round its top-1: a greedy verify accepts depth 1 iff the
        token is among them. Counting the top-1 hit as the tree's (as before) read the chat workload's depth-1
        acceptance far below the tree's, and a server that once stopped speculating never started
        again: its probes were its only evidence (issue 32). An n-gram drafter's guesses are its lookup's,
        made before the round (`first_guesses`): free, so a model-free request at depth 0 probes every round,
        where a verify-row probe waited for the probe budget and a grounded n-gram server whose first requests
        found no matches never speculated again (issue 32). A hybrid's: its draft's top-k where `caught_up`, then
        its n-gram half's guesses; not caught up, the n-gram's alone (`_free_guesses`)."""
        first_level = self.policy.rows(1) - 1  # a full-width depth-1 round's nodes past the root
        guesses = self._guesses.pop(request.request_id, None)
        state = request.spec_state if caught_up else None
        if state is not None:  # a draft model's top-k first (a hybrid's n-gram guesses after it)
            guesses = list(state.topk_ids) + [t for t in guesses or () if t not in state.topk_ids]
        elif guesses == []:  # an n-gram without a match had nothing to offer: no outcome (it probes again next round)
            return
        if guesses is None or not committed:
            hit = top = False
        else:
            hit, top = committed[0] in guesses[:first_level], committed[0] == guesses[0]
        self.policy.observe(request.request_id, 1, int(hit), top_path=int(top), shadow=True)

    def _plain_round(self, batch: ScheduledBatch, suppress, t_round: float, shadow: set) -> list[SampledTokens]:
        """Every decode request at depth 0: a plain decode step (the runner's batched sampling, no trees, no
        per-request verify). The draft features of what each request commits are kept for its catch-up;
        `shadow`: requests whose probe is this round's committed token against their caught-up draft."""
        runner, policy = self.runner, self.policy
        items = batch.items
        ids: list[int] = []
        positions: list[int] = []
        q_lens = []
        for it in items:
            req = it.request
            if it.spec_decode:  # the root: the last committed token, at the position of its KV
                ids.append(req.all_token_ids[-1])
                positions.append(it.start)
                q_lens.append(1)
            else:
                ids.extend(req.all_token_ids[it.start:it.start + it.num_tokens])
                positions.extend(range(it.start, it.start + it.num_tokens))
                q_lens.append(it.num_tokens)
        t0 = time.perf_counter()
        hidden, features, _ = self._target_forward(ids, positions, q_lens,
                                                   [it.start + q for it, q in zip(items, q_lens)],
                                                   [it.request.pages for it in items], [None] * len(items), [])
        results = runner.sample_items(items, q_lens, hidden, suppress)
        target_s = time.perf_counter() - t0
        decode_only = all(it.spec_decode for it in items)  # no prefill chunk: the round's cost is a decode's
        if decode_only:
            policy.cost.observe_target(len(items), len(ids), target_s)
        extends, offset = [], 0
        for it, q, res in zip(items, q_lens, results):
            rid = it.request.request_id
            rows = features[offset:offset + q]
            offset += q
            if it.spec_decode:
                res.num_accepted = None  # a plain decode step, not a verify: tau counts verifies only
                if rid in shadow or rid in self._free:
                    self._observe_shadow(it.request, res.token_ids, caught_up=rid in shadow)
                else:
                    policy.observe(rid, 0, 0)
                policy.stats.record(0, off=True)
                ext = DraftExtend(it.request, it.start, res.token_ids, rows, at_end=True)
                if self.proposer.needs_hidden:  # run when the request speculates next
                    self._defer(ext)
                else:
                    extends.append(ext)
            else:
                ext = self._prompt_extend_now(_prompt_extend(it, res.token_ids, rows), it)
                if ext is not None:
                    extends.append(ext)
        if extends:
            self.proposer.extend(extends)
        if decode_only and not self._costly(shadow):  # a catch-up is not what a depth-0 round costs
            policy.cost.observe_round(len(items), time.perf_counter() - t_round - target_s, False, 0.0)
            self._last_round = (t_round, len(items), False, time.perf_counter() - t_round)
        return results

    def _target_forward(self, ids, positions, q_lens, kv_lens, page_lists, masks, logit_rows):
        """hidden [N, H], draft features [N, H_in], logits [len(logit_rows), vocab] fp32 (the forward replayed
        from a CUDA graph where one fits: ModelRunner.forward)."""
        runner = self.runner
        aux = self.proposer.aux_layer_ids
        hidden, captured = runner.forward(ids, positions, q_lens, kv_lens, page_lists, masks, capture_layers=aux)
        features = torch.cat(captured, dim=-1) if aux else hidden  # what the draft consumes
        logits = runner.model.compute_logits(hidden[logit_rows]) if logit_rows else hidden.new_zeros(0, 0)
        return hidden, features, logits

    # -- per item ---------------------------------------------------------------------------
    def _prefill(self, it: ScheduledItem, logits, features, suppress):
        """logits [1, vocab] at the item's last row when it samples, else None."""
        req = it.request
        token_ids, logprobs = [], []
        if it.samples:
            faults = self.runner.faults
            mask_logits(logits, [req.grammar], faults, [req.request_id])
            row = self._row(it, [], suppress)
            raw = logits.clone() if row.params.logprobs is not None else None
            token = sample(process_logits(logits, [row], faults), [row], self.runner.shared_generator, faults)[0]
            token_ids = [token]
            logprobs = compute_logprobs(raw, [token], [row]) if raw is not None else [None]
        ext = _prompt_extend(it, token_ids, features)
        return SampledTokens(req.request_id, token_ids, logprobs, it.num_tokens), ext

def build_spec_runner(runner: ModelRunner, spec, frozen_policy: bool = False) -> SpecRunner:
    """frozen_policy: the adaptive policy neither learns engine-wide nor refines its measured costs."""
    cfg = runner.model_config
    steps, topk, num_tokens = spec.num_steps, spec.topk, spec.num_draft_tokens
    if spec.speculative_algorithm == "replay":
        from specpd.spec.draft.replay import ReplayProposer
        proposer = ReplayProposer(steps, topk, num_tokens, cfg.vocab_size)
    elif spec.speculative_algorithm == "ngram":
        proposer = _ngram(spec, steps, topk, num_tokens)
    else:
        from specpd.spec.draft.loader import load_draft_model
        if spec.draft_model:
            draft = load_draft_model(spec.draft_model, spec.speculative_algorithm, runner.model, cfg, runner.dtype)
        elif spec.speculative_algorithm == "mtp":  # the target checkpoint's own MTP layers
            from specpd.spec.draft.checkpoint_mtp import load_checkpoint_mtp
            draft = load_checkpoint_mtp(runner.config.model, runner.model, cfg, runner.dtype)
        else:
            raise ValueError(f"--speculative-algorithm {spec.speculative_algorithm} needs --draft-model")
        # the draft's layers inside the target's pages (the runner reserved them), else its own pool (under
        # tensor parallelism the draft runs whole on rank 0, every head, in a pool of its own)
        pool = runner.kv_pool
        shared = None
        if runner.tp is None and pool.extra_layers == draft.config.num_layers:
            shared = type(pool).layers_of(pool)  # a KVPool, or the latent rows of an MLA target
        quantize = spec.spec_draft_quantization == "int8" or (spec.spec_draft_quantization == "auto"
                                                               and runner.config.quantization != "none")
        proposer = EagleProposer(draft, pool, runner.config.attention_backend, steps, topk, num_tokens, pool=shared,
                                 graphs=runner.graph_settings, quantize=quantize)
        if spec.hybrid:
            proposer = HybridProposer(proposer, _ngram(spec, max(steps, num_tokens - 1), topk, num_tokens))
    policy = None
    if spec.spec_adaptive:
        frozen = frozen_policy or spec.spec_adaptive_pinned
        # measured: the forwards a round runs, timed through a runner of the same parts that has no policy yet
        cost = (CostModel.pinned(not proposer.model_free) if spec.spec_adaptive_pinned
                else calibrate(SpecRunner(runner, proposer)))
        cost.frozen = frozen
        # pinned: a catch-up priced as work moved earlier (AdaptivePolicy.catch_up_settled), whatever the cache, so
        # a request's rounds (and acceptance) depend on its own history only; measured: priced as the work it adds
        settled = spec.spec_adaptive_pinned and proposer.needs_hidden
        policy = AdaptivePolicy(proposer.num_steps, topk, proposer.num_draft_tokens, cost, frozen=frozen,
                                shadow=proposer.needs_hidden or isinstance(proposer, NgramProposer),
                                catch_up_settled=settled)
    return SpecRunner(runner, proposer, policy)


def _ngram(spec, steps: int, topk: int, num_tokens: int) -> NgramProposer:
    return NgramProposer(steps, topk, num_tokens, spec.ngram_min_match, spec.spec_ngram_max_match,
                         spec.spec_ngram_store_tokens)


def _prompt_extend(it: ScheduledItem, sampled: list[int], features) -> DraftExtend:
    """The draft's extend over a prefill chunk: each position's input is the token after it (the sampled one
    after the prompt's last), so the draft predicts one ahead of the target."""
    req = it.request
    nxt = sampled[0] if it.samples else req.all_token_ids[it.start + it.num_tokens]
    shifted = req.all_token_ids[it.start + 1:it.start + it.num_tokens] + [nxt]
    return DraftExtend(req, it.start, shifted, features, at_end=it.samples)
