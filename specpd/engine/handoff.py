"""The engine's PD hooks (specpd/disagg): a prefill server's handoff out, a decode server's handoff in.

P: `add_request(..., prefill_only=True)` stops after the handoff token y0 and keeps the pages (`_handoff`,
then `take_handoff` / `release_handoff`); draft-on-decode-only with a prefix cache, a cached page also keeps
its target features (`feature_pages`), which D needs for every position.
D: `add_prebuilt_request` commits a handoff from P (prompt KV already in the pages, y0 sampled) with no
forward; draft-on-decode-only, it runs the draft extend over the prompt's target features from P, or
`draft_extend_prompt_part` ran it over each streamed chunk's before the record came.
"""
from __future__ import annotations

import time

import torch

from specpd.core import Request, RequestOutput, SamplingParams, TokenLogprob
from specpd.spec.draft.proposer import DraftExtend
from specpd.engine.detokenizer import IncrementalDetokenizer


class HandoffHooks:
    """LLMEngine's PD hooks (module docstring); they work on the engine's scheduler, runner, spec_runner,
    detokenizers and outputs like the rest of LLMEngine."""

    def take_handoff(self, request_id: str) -> Request | None:
        """A prefill-only request whose y0 is sampled: its pages hold the prompt KV until released."""
        return self._handoffs.get(request_id)

    def release_handoff(self, request_id: str) -> None:
        req = self._handoffs.pop(request_id, None)
        if req is not None:
            req.spec_state = None
            self.scheduler.release_pages(req)
            req.handoff_hidden = None

    def add_prebuilt_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                             pages: list[int], handoff_token: int, handoff_logprob: TokenLogprob | None,
                             draft_state=None, target_hidden: torch.Tensor | None = None,
                             sampler_state: torch.Tensor | None = None, cache_node=None,
                             cached_tokens: int = 0, draft_start: int | None = None) -> Request:
        """Commit P's handoff: `pages` (allocated from this engine's allocator) hold KV for positions
        0..N-1, y0 is appended (stop checks apply) and has no KV yet; the next step decodes it. No target
        forward. With speculation: draft-on-both, `draft_state` is P's first-round proposal (the draft KV
        came in the same pages); draft-on-decode-only, `target_hidden` [N, H_in] are the prompt's target
        features and the draft extend over the prompt runs here, exactly as the colocated engine runs it
        after its prefill. `sampler_state`: the request generator's state on P after sampling y0.
        `cache_node` / `cached_tokens`: the first pages came from this engine's prefix cache (locked at D's
        prealloc; target and draft KV below `cached_tokens`); `target_hidden` then covers the positions after.
        `draft_start` (decode-only, default `cached_tokens`): the draft KV already covers the positions below it
        (`draft_extend_prompt_part` ran over the chunks streamed before), and `target_hidden` starts there."""
        draft_start = cached_tokens if draft_start is None else draft_start
        needs_hidden = self.spec_runner is not None and self.spec_runner.proposer.needs_hidden
        if needs_hidden and draft_state is None and target_hidden is None:
            raise ValueError(f"request {request_id!r}: a handoff to a speculative decode server needs P's "
                             f"draft state (draft-on-both) or the prompt's target hidden states (decode-only)")
        if target_hidden is not None and target_hidden.shape[0] != len(prompt_token_ids) - draft_start:
            raise ValueError(f"request {request_id!r}: target_hidden has {target_hidden.shape[0]} rows for a "
                             f"{len(prompt_token_ids)}-token prompt drafted up to {draft_start}")
        req = Request(request_id, list(prompt_token_ids), params, arrival=time.monotonic())
        req.pages = list(pages)
        req.num_computed_tokens = len(prompt_token_ids)
        req.cache_node, req.num_cached_tokens = cache_node, cached_tokens
        if self._draft_kv:  # draft-on-both: P's draft KV came in the pages; decode-only: the extend below
            req.draft_kv_len = len(prompt_token_ids) if draft_state is not None else draft_start
        req.spec_state = draft_state
        if params.constraint_kind is not None:  # rebuilt from the constraint text; y0 advances it below
            req.grammar = self.grammar.matcher(params.constraint_kind, params.constraint_spec)
        if sampler_state is not None and (gen := self.runner.generator_for(req)) is not None:
            gen.set_state(sampler_state)
        if needs_hidden and draft_state is None:
            self._draft_extend_prompt(req, handoff_token, target_hidden, draft_start)
        self._detok[request_id] = IncrementalDetokenizer(self.tokenizer, req.prompt_token_ids, params.stop,
                                                         params.skip_special_tokens) if self.tokenizer else None
        self.scheduler.add_running(req)
        self.counters["prompt_tokens"] += len(prompt_token_ids)
        req.first_token_time = time.monotonic()
        new_ids, new_lps, reason = self._append(req, [handoff_token], [handoff_logprob])
        if reason is not None:
            self._finish([(req, reason)])
        out = (self._finish_output(req, new_ids, new_lps) if reason is not None
               else self._output(req, new_ids, new_lps, final=False))
        self._pending_outputs.append(out)
        return req

    def _draft_extend_prompt(self, req: Request, handoff_token: int, target_hidden: torch.Tensor,
                             first: int = 0) -> None:
        """Draft-on-decode-only: the draft extend the colocated engine runs after each prefill chunk
        (SpecRunner._prefill: tokens x_{s+1}..x_{s+n}, y0 last, with the target features of s..s+n-1), from
        position `first` (the draft KV before it is in D's cached pages; target_hidden starts there). Under the
        adaptive policy as served it waits for the request's first catch-up, as a colocated prompt's does
        (SpecRunner.defer_prompt)."""
        n = len(req.prompt_token_ids)
        shifted = req.prompt_token_ids[1:] + [handoff_token]
        hidden = target_hidden.to(self.runner.device)
        if self.spec_runner.defer_prompt(DraftExtend(req, first, shifted[first:], hidden, at_end=True)):
            return
        chunk = self.config.scheduler.chunked_prefill_size or n
        with torch.inference_mode():
            for start in range(first, n, chunk):
                end = min(n, start + chunk)
                self.spec_runner.proposer.extend([DraftExtend(req, start, shifted[start:end],
                                                              hidden[start - first:end - first], at_end=end == n)])

    def draft_extend_prompt_part(self, prompt_token_ids: list[int], pages: list[int], start: int,
                                 target_hidden: torch.Tensor) -> None:
        """Draft-on-decode-only with the features streamed per chunk (PD): the draft extend over prompt
        positions start..start+n-1 into `pages`, before the handoff commits (tokens x_{s+1}..x_{s+n}, all in
        the prompt: the position before y0 runs at commit, `add_prebuilt_request(draft_start=...)`)."""
        n = target_hidden.shape[0]
        if self.spec_runner is None or not self.spec_runner.proposer.needs_hidden:
            raise ValueError("target features sent to a decode server whose drafter takes none")
        if start + n >= len(prompt_token_ids):
            raise ValueError(f"target features up to position {start + n - 1} of a {len(prompt_token_ids)}-token "
                             f"prompt: the last one comes with the handoff record")
        staging = Request("draft-extend", list(prompt_token_ids), SamplingParams())  # only its pages are read
        staging.pages = list(pages)
        with torch.inference_mode():
            self.spec_runner.proposer.extend([DraftExtend(staging, start, prompt_token_ids[start + 1:start + n + 1],
                                                          target_hidden.to(self.runner.device), at_end=False)])

    def _handoff(self, req: Request, sampled) -> RequestOutput:
        """Prefill-only: y0 is sampled; keep the pages for the transfer, no stop checks (D applies them)."""
        self.scheduler.detach(req)
        req.finish_reason = "handoff"
        req.output_token_ids = list(sampled.token_ids[:1])
        lp = sampled.logprobs[0] if sampled.logprobs else None
        req.output_logprobs = [lp] if lp is not None else []
        self._handoffs[req.request_id] = req
        self._detok.pop(req.request_id, None)
        draft_state = req.spec_state  # the proposer's first-round proposal: it travels to D (draft-on-both)
        if req.params.seed is not None:  # D's generator continues from here: seeded PD == colocated
            req.sampler_state = self.runner.generator_for(req).get_state()
        self.step_runner.release(req)
        req.spec_state = draft_state
        return RequestOutput(req.request_id, list(req.output_token_ids), "", list(req.output_token_ids), "",
                             True, "handoff", req.num_prompt_tokens,
                             [lp] if (lp is not None and req.params.logprobs is not None) else None)


def feature_pages(req: Request, num_pages: int, page_size: int) -> list | None:
    """Per-page copies of a prefill-only request's target features (P, draft-on-decode-only), or None."""
    if not req.handoff_hidden:
        return None
    feats = torch.cat(req.handoff_hidden)
    if feats.shape[0] < num_pages * page_size:
        return None
    return [feats[k * page_size:(k + 1) * page_size].clone() for k in range(num_pages)]
