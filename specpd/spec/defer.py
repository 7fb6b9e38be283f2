"""The draft extends a request has not run yet (SpecRunner's bookkeeping; policy.py 4, 4b, 4c say when).

Under the adaptive policy an EAGLE-family request's draft extend waits:
  - a round's extend while the request is at depth 0 (a plain step, or a depth-0 request in a speculating round),
    its target features kept (`_defer`: priced, what speculating again would add);
  - its prompt's extend, chunk by chunk (`_prompt_extend_now`; a PD decode server's in draft-on-decode-only mode,
    `defer_prompt`): unpriced, work the eager extend did at prefill. Not with a frozen policy (its rounds then
    equal a PD decode server's exactly), nor on a PD prefill server (its handoff carries the draft's proposal),
    nor past `defer_prompt_tokens` of features kept.
They run as one slice per request (`_merged`, they are consecutive) when the request next speculates or
shadow-probes (`_catch_up`, its proposal refreshed). A prefill item whose start is not where its deferred extends
end is a recompute: they are dropped. What never ran when a request lets go of its pages stays with them in the
prefix cache, as the target features the draft's KV would be built from (`cache_payloads`, one tensor per page
from the first whose draft KV lags); a request that hits those pages takes them back as the deferred extend of
its prompt (`adopt_cached`, then `_prompt_extend_now`). So a request that never speculates costs no draft forward
at all, and a later one over the same prefix builds the draft KV only if it speculates. (Until this, a finishing
request ran its deferred extends, KV only, so that the cache kept its pages: in a large chat batch those settles
and the catch-ups they made cheap were a real share of the engine's step, as evals/spec_depth0.py times it.)
"""
from __future__ import annotations

import torch

from specpd.core import ScheduledItem
from specpd.spec.draft.proposer import DraftExtend

# a request's deferred prompt extend runs at once past this many tokens of target features kept (EAGLE-3: 3 hidden
# states a token, ~14 MB at 4096 tokens of SmolLM2 in bf16)
DEFER_PROMPT_TOKENS = 4096


class DeferredExtends:
    """Mixed into SpecRunner, which provides `policy` and `proposer`."""

    def __init__(self):
        # request id -> draft extends not run yet (adaptive: the request did not speculate since)
        self._deferred: dict[str, list[DraftExtend]] = {}
        self._pending: dict[str, int] = {}  # request id -> tokens in its deferred decode extends (priced)
        self._prompt_pending: dict[str, int] = {}  # request id -> tokens in its deferred prompt extends (unpriced)
        self.defer_prompt_tokens = DEFER_PROMPT_TOKENS  # (0: every prompt extend at once, as before; evals compare)

    # -- the prefix cache (Scheduler.draft_cache) ----------------------------------------
    def cache_payloads(self, request, valid: int) -> tuple[int, list]:
        """A request letting go of its pages, `valid` positions of target KV: (positions the cache may keep, one
        payload per full page: None where the draft's KV is built, else the target features of the page's positions
        past `draft_kv_len`), from its deferred extends. Without them, only the pages below `draft_kv_len`."""
        lag, ps = request.draft_kv_len, self.runner.kv_pool.page_size
        parts = self._deferred.get(request.request_id)
        if lag >= valid or not parts or parts[0].start != lag:
            valid = min(valid, lag)
            return valid, [None] * (valid // ps)
        feats = torch.cat([p.hidden for p in parts]) if len(parts) > 1 else parts[0].hidden
        valid = min(valid, lag + feats.shape[0])
        # on the host: a GPU pool sized to its budget must not lose memory to cached features
        return valid, [None if (k + 1) * ps <= lag else feats[max(k * ps, lag) - lag:(k + 1) * ps - lag].to(
            "cpu", copy=True) for k in range(valid // ps)]

    def adopt_cached(self, request, payloads: list) -> int:
        """A prefix-cache hit on pages with these payloads (`cache_payloads`): how many to take (the lagging ones
        must be the last, consecutive: the match is cut at a gap), with `draft_kv_len` and `cached_draft` (the
        features, deferred as the prompt's extend by `_prompt_extend_now`) set to match."""
        ps = self.runner.kv_pool.page_size
        first = next((k for k, p in enumerate(payloads) if p is not None), None)
        self._drop_deferred(request.request_id)  # a (re)admission: what a preempted request deferred is stale
        request.cached_draft = None
        if first is None:
            request.draft_kv_len = len(payloads) * ps
            return len(payloads)
        keep = first + 1
        while keep < len(payloads) and payloads[keep] is not None and payloads[keep].shape[0] == ps:
            keep += 1
        start = (first + 1) * ps - payloads[first].shape[0]
        request.draft_kv_len = start
        request.cached_draft = (start, torch.cat(payloads[first:keep]).to(self.runner.device))
        return keep

    def _prompt_extend_now(self, ext: DraftExtend, it: ScheduledItem) -> DraftExtend | None:
        """A prefill chunk's draft extend: None when deferred, else what to run in this round's extend.

        Where `defers_prompts`, the prompt's extend waits with the request's deferred decode extends for its first
        speculating round or a shadow probe, in one draft forward, or goes to the prefix cache with its pages
        (`cache_payloads`): a request that never speculates (a batch where speculation does not pay) then costs no
        draft forward, and the first token does not wait for the draft. A prefix-cache hit's lagging part
        (`adopt_cached`) heads it."""
        req, rid = it.request, it.request.request_id
        if req.cached_draft is not None:  # a prefix-cache hit's lagging draft KV: its features head the prompt's
            start, feats = req.cached_draft
            req.cached_draft = None
            self._drop_deferred(rid)
            self._defer(DraftExtend(req, start, req.all_token_ids[start + 1:start + 1 + feats.shape[0]], feats,
                                    at_end=False), priced=False)
        parts = self._deferred.get(rid)
        if parts and parts[-1].start + len(parts[-1].token_ids) != it.start:
            self._drop_deferred(rid)  # a recompute (after preemption) starts over
            parts = None
        defer = self.defers_prompts(it.request)
        if parts is None and not defer:
            return ext
        self._defer(ext, priced=False)
        if defer and self._pending.get(rid, 0) + self._prompt_pending[rid] <= self.defer_prompt_tokens:
            return None
        return self._merged(rid, refresh=ext.at_end)

    def defers_prompts(self, request) -> bool:
        """Whether `request`'s prompt extend waits (`_prompt_extend_now`; a PD decode server's handoff in
        draft-on-decode-only mode too, HandoffHooks)."""
        policy = self.policy
        return (policy is not None and not policy.frozen and self.proposer.needs_hidden and not request.prefill_only)

    def defer_prompt(self, ext: DraftExtend) -> bool:
        """A PD decode server's prompt extend (draft-on-decode-only, at the handoff's commit): deferred as a
        colocated prefill's would be (True), or for the caller to run now."""
        if not self.defers_prompts(ext.request) or len(ext.token_ids) > self.defer_prompt_tokens:
            return False
        self._defer(ext, priced=False)
        return True

    def _defer(self, ext: DraftExtend, priced: bool = True) -> str:
        rid = ext.request.request_id
        self._deferred.setdefault(rid, []).append(ext)
        counts = self._pending if priced else self._prompt_pending
        counts[rid] = counts.get(rid, 0) + len(ext.token_ids)
        return rid

    def _drop_deferred(self, request_id: str) -> list[DraftExtend] | None:
        self._pending.pop(request_id, None)
        self._prompt_pending.pop(request_id, None)
        return self._deferred.pop(request_id, None)

    def _merged(self, request_id: str, refresh: bool = True) -> DraftExtend | None:
        """A request's deferred extends as one slice (they are consecutive), taken off the deferred."""
        parts = self._drop_deferred(request_id)
        if not parts:
            return None
        tokens = [t for p in parts for t in p.token_ids]
        return DraftExtend(parts[0].request, parts[0].start, tokens, torch.cat([p.hidden for p in parts]),
                           at_end=refresh)

    def _catch_up(self, requests) -> int:
        """Run the deferred draft extends of requests about to draft, their proposals refreshed, one slice per
        request, in one extend call. Returns the rows it ran."""
        extends = [ext for req in requests if (ext := self._merged(req.request_id)) is not None]
        if extends:
            self.proposer.extend(extends)
        return sum(len(ext.token_ids) for ext in extends)
