"""The engine: `step()` is schedule -> run -> postprocess.

Lifecycle of a request inside the engine:
  1. `add_request` validates it against the model (context length, vocabulary, KV capacity) and
     queues it in the scheduler.
  2. `step` schedules a batch (decodes + prefill chunks under the token budget), the model runner
     runs one forward and samples for every sequence that reached its end.
  3. `_postprocess` appends tokens with stop checks (EOS / stop token ids / stop strings /
     max_tokens / context length), detokenizes incrementally and frees finished requests' pages.
  4. `abort_request` finishes a request at the next step with reason "abort".
PD hooks (specpd/disagg, handoff.py): `add_request(..., prefill_only=True)` stops after the handoff token y0
and keeps the pages (`take_handoff` / `release_handoff`); `add_prebuilt_request` commits a handoff from P
(prompt KV already in the pages, y0 sampled) with no forward.
"""
from __future__ import annotations

import logging
import time

from specpd.config import EngineConfig, ModelConfig
from specpd.core import EngineBroken, InvalidRequest, Request, RequestOutput, SamplingParams, TokenLogprob
from specpd.engine.detokenizer import IncrementalDetokenizer
from specpd.engine.handoff import HandoffHooks, feature_pages
from specpd.engine.scheduler import Scheduler
from specpd.spec.runner import SpecRunner, build_spec_runner
from specpd.spec.stats import SpecStats
from specpd.kv.allocator import pages_needed
from specpd.kv.radix import RadixCache
from specpd.machine import collapse_later_in_background, starting_up
from specpd.model.loader import load_checkpoint
from specpd.model.runner import ModelRunner, StepRunner

logger = logging.getLogger(__name__)

MAX_FAILED_STEPS = 3  # steps in a row that fail with no request to blame: the engine is broken, not a request


class LLMEngine(HandoffHooks):
    def __init__(self, config: EngineConfig, checkpoint=None, with_draft: bool = True, pd_role: str | None = None):
        """with_draft=False (a PD prefill server in draft-on-decode-only mode): no draft model is loaded;
        prefill-only requests keep the target features the draft consumes for the handoff instead.
        pd_role: "prefill" / "decode" for a PD server (under tensor parallelism it keeps whole pages to hand off)."""
        with starting_up():  # its calibration times this machine: no huge-page collapse beside it (machine.py)
            self._build(config, checkpoint, with_draft, pd_role)
        # built and calibrated: what start-up left on 4 KB pages, collapsed while no request waits (machine.py)
        collapse_later_in_background(busy=self.has_unfinished_requests)

    def _build(self, config: EngineConfig, checkpoint, with_draft: bool, pd_role: str | None) -> None:
        self.config = config
        checkpoint = checkpoint or load_checkpoint(config.model)
        self.model_config = ModelConfig.from_hf(checkpoint.hf_config)
        self.model_name = config.model  # served name, like vLLM: the --model argument as given
        self.tokenizer = checkpoint.tokenizer
        self.max_model_len = min(config.max_model_len or self.model_config.max_position_embeddings,
                                 self.model_config.max_position_embeddings)
        spec = config.spec.validate()
        draft_layers, capture = 0, None
        if spec.enabled and with_draft:
            from specpd.spec.draft.loader import shared_page_layers
            draft_layers = shared_page_layers(spec, self.model_config)
        elif spec.enabled and not spec.model_free:  # P, draft-on-decode-only: it hands D the draft's features
            from specpd.spec.draft.loader import draft_feature_layers
            capture = draft_feature_layers(spec.draft_model, spec.speculative_algorithm, self.model_config.num_layers)
        self.runner = ModelRunner(config, checkpoint, self.max_model_len, kv_extra_layers=draft_layers, pd_role=pd_role,
                                  handoff_capture=capture)
        pool = self.runner.kv_pool
        # what step() runs: speculation over the model runner, or the model runner itself (plain decoding)
        self.step_runner: StepRunner = build_spec_runner(self.runner, spec) if spec.enabled and with_draft \
            else self.runner
        self.decode_width = self.step_runner.decode_width
        # pages carry draft KV: a cached page needs the token after it to match too (specpd/kv/radix.py)
        self._draft_kv = self.spec_runner is not None and not self.spec_runner.proposer.model_free
        self.prefix_cache = (RadixCache(pool.allocator, pool.page_size, lookahead=int(self._draft_kv))
                             if config.cache.enable_prefix_caching else None)
        cached = self.prefix_cache is not None
        self.scheduler = Scheduler(
            config.scheduler, pool.allocator, pool.page_size, self.decode_width, cache=self.prefix_cache,
            # the draft's deferred extends stay with cached pages
            draft_cache=self.spec_runner if cached and self._draft_kv else None,
            # P, draft-on-decode-only: D needs every feature, cached pages' too
            page_payloads=(lambda req, n: feature_pages(req, n, pool.page_size)) if cached and capture is not None
            else None)
        eos = set(self.model_config.eos_token_ids)
        if self.tokenizer is not None:
            eos.update(self.tokenizer.eos_token_ids)
        self.eos_token_ids = tuple(sorted(eos))
        self._detok: dict[str, IncrementalDetokenizer] = {}
        self._aborted: list[str] = []
        self._failed_steps = 0  # steps in a row that failed with no request to blame (`_contain`)
        self._handoffs: dict[str, Request] = {}  # PD prefill: prefilled requests holding their pages
        self._pending_outputs: list[RequestOutput] = []  # produced outside step() (committed handoffs)
        self.counters = {"prompt_tokens": 0, "generation_tokens": 0, "requests_finished": 0}
        self.spec_stats = SpecStats(self.spec_runner.proposer.num_steps if self.spec_runner else config.spec.num_steps)
        self._grammar = None  # specpd.grammar.backend.GrammarBackend, built at the first constrained request
        logger.info("runtime: %s", ", ".join(f"{k} {v}" for k, v in self.runner.runtime_info().items()))

    @property
    def spec_runner(self) -> SpecRunner | None:
        """The step runner when it speculates (its proposer, policy and deferred extends), else None."""
        return self.step_runner if isinstance(self.step_runner, SpecRunner) else None

    # -- public API ------------------------------------------------------------------------
    @property
    def free_pages(self) -> int:
        """Pages no request holds: free, plus cached pages nobody references (evicted on demand)."""
        return self.runner.kv_pool.allocator.num_available

    def flush_cache(self) -> int:
        """Drop every unreferenced cached page (SGLang's /flush_cache); returns how many."""
        return self.prefix_cache.flush() if self.prefix_cache is not None else 0

    @property
    def total_pages(self) -> int:
        return self.runner.kv_pool.num_pages

    def stats(self) -> dict:
        return {"num_running": len(self.scheduler.running), "num_waiting": len(self.scheduler.waiting),
                "free_pages": self.free_pages, "total_pages": self.total_pages,
                "page_size": self.runner.kv_pool.page_size, **self.counters,
                "prefix_caching": self.prefix_cache is not None,
                **(self.prefix_cache.stats() if self.prefix_cache is not None else {}),
                **(self.spec_stats.as_dict() if self.config.spec.enabled else {}), **self._policy_stats(),
                **(self._grammar.stats.as_dict() if self._grammar is not None else {}),
                "runtime": self.runner.runtime_info()}

    @property
    def grammar(self):
        """The grammar backend over this engine's tokenizer; its stop set is the engine's EOS ids."""
        if self._grammar is None:
            from specpd.grammar.backend import GrammarBackend  # xgrammar loads only when a request needs it
            self._grammar = GrammarBackend(self.tokenizer, self.model_config.vocab_size, self.eos_token_ids)
        return self._grammar

    def _policy_stats(self) -> dict:
        policy = self.spec_runner.policy if self.spec_runner is not None else None
        if policy is None:
            return {}
        st = policy.stats
        hist = [st.proposed_hist.get(n, 0) for n in range(max(st.proposed_hist, default=0) + 1)]
        return {"spec_rounds": st.rounds, "spec_rounds_off": st.rounds_off,
                "spec_rounds_off_share": st.rounds_off / st.rounds if st.rounds else None,
                "spec_rounds_narrow": st.rounds_narrow, "spec_probes": st.probes, "spec_draft_tokens_hist": hist,
                "spec_policy": {"cost_scale": policy.cost.scale, "draft_scale": policy.cost.draft_scale,
                                "accept": list(policy.global_accept), "prior": policy.prior_rates(),
                                "top_path_share": policy.top_path_share(),
                                "cost_model": policy.cost.as_dict()}}

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                    prefill_only: bool = False, follows: str | None = None) -> Request:
        """follows: the request id of the first of a request's parallel samples (n > 1): this one starts once
        that one has computed the prompt, and takes its prompt's pages from the prefix cache."""
        self.validate_request(request_id, prompt_token_ids, params)
        req = Request(request_id, list(prompt_token_ids), params, arrival=time.monotonic(), prefill_only=prefill_only)
        if follows is not None and self.prefix_cache is not None:
            req.prefix_leader = self.scheduler.find(follows)
        if self._draft_kv:
            req.draft_kv_len = 0
        self._detok[request_id] = IncrementalDetokenizer(self.tokenizer, req.prompt_token_ids, params.stop,
                                                         params.skip_special_tokens) if self.tokenizer else None
        if params.constraint_kind is not None:
            req.grammar = self.grammar.matcher(params.constraint_kind, params.constraint_spec)
        self.scheduler.add(req)
        self.counters["prompt_tokens"] += len(prompt_token_ids)
        return req

    def validate_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """Raise InvalidRequest naming the field if the engine cannot serve this request."""
        params.validate()
        n = len(prompt_token_ids)
        if n == 0:
            raise InvalidRequest("prompt", "must not be empty")
        vocab = self.model_config.vocab_size
        if any(not isinstance(t, int) or not 0 <= t < vocab for t in prompt_token_ids):
            raise InvalidRequest("prompt", f"token ids must be integers in [0, {vocab})")
        for field, ids in (("logit_bias", [t for t, _ in params.logit_bias]), ("stop_token_ids", params.stop_token_ids)):
            if bad := [t for t in ids if t >= vocab]:
                raise InvalidRequest(field, f"token id {bad[0]} is outside the vocabulary [0, {vocab})")
        if n + params.max_tokens + self.decode_width - 1 > self.max_model_len:
            # the prompt's fault when it leaves no room for even one token, else max_tokens'
            field = "prompt" if n + self.decode_width > self.max_model_len else "max_tokens"
            raise InvalidRequest(field, f"prompt ({n} tokens) + max_tokens ({params.max_tokens}) "
                                 f"exceeds the context length {self.max_model_len}")
        page_size = self.runner.kv_pool.page_size
        if pages_needed(n + params.max_tokens + self.decode_width, page_size) > self.total_pages:
            raise InvalidRequest("max_tokens", f"prompt + max_tokens ({n + params.max_tokens} tokens) exceeds "
                                 f"the KV cache capacity ({self.total_pages * page_size} tokens)")
        if self.scheduler.find(request_id) is not None:
            raise InvalidRequest("request_id", f"duplicate request id {request_id!r}")
        if params.constraint_kind is not None:  # a cache hit when the server compiled it first
            self.grammar.compile(params.constraint_kind, params.constraint_spec)

    def abort_request(self, request_id: str) -> None:
        self._aborted.append(request_id)

    def dead_ranks(self) -> list[int]:
        """Tensor-parallel ranks whose process exited (the engine cannot step again); [] at TP 1."""
        return self.runner.tp.dead_ranks() if self.runner.tp is not None else []

    def close(self) -> None:
        """Stop what the engine started outside this process (tensor-parallel worker ranks); idempotent."""
        self.runner.close()

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished() or bool(self._aborted) or bool(self._pending_outputs)

    def take_pending_outputs(self) -> list[RequestOutput]:
        """Outputs produced outside step() (a committed PD handoff's y0): a PD worker streams them at once."""
        outputs, self._pending_outputs = self._pending_outputs, []
        return outputs

    def step(self) -> list[RequestOutput]:
        outputs = self.take_pending_outputs()
        outputs += self._process_aborts()
        batch = self.scheduler.schedule()
        if not batch:
            return outputs
        try:
            result = self.step_runner.execute(batch, self._suppressed_ids(batch))
        except Exception as exc:  # noqa: BLE001 - contained, or re-raised when the engine itself is broken
            return outputs + self._contain(batch, exc)
        self._failed_steps = 0
        return outputs + self._postprocess(batch, result)

    def generate(self, prompts: list[list[int]], params: SamplingParams | list[SamplingParams]) -> list[RequestOutput]:
        """Offline helper: run the prompts to completion, outputs in input order."""
        plist = params if isinstance(params, list) else [params] * len(prompts)
        ids = [f"offline-{time.monotonic_ns()}-{i}" for i in range(len(prompts))]
        for rid, prompt, p in zip(ids, prompts, plist):
            self.add_request(rid, prompt, p)
        final: dict[str, RequestOutput] = {}
        while self.has_unfinished_requests():
            for out in self.step():
                if out.finished:
                    final[out.request_id] = out
        return [final[rid] for rid in ids]

    # -- internals -------------------------------------------------------------------------
    def _suppressed_ids(self, batch) -> dict[str, tuple[int, ...]]:
        out = {}
        for it in batch.items:
            p = it.request.params
            if it.samples and len(it.request.output_token_ids) < p.min_tokens:
                # a constrained request's EOS is the grammar's to allow: min_tokens does not hold it back
                eos = () if p.ignore_eos or it.request.grammar is not None else self.eos_token_ids
                out[it.request.request_id] = tuple(p.stop_token_ids) + eos
        return out

    def _process_aborts(self) -> list[RequestOutput]:
        outputs = []
        for rid in self._aborted:
            req = self.scheduler.find(rid)
            if req is not None:
                self.scheduler.finish(req, "abort")
                outputs.append(self._finish_output(req, [], None))
        self._aborted.clear()
        return outputs

    def _contain(self, batch, exc: Exception) -> list[RequestOutput]:
        """A step failed where no single request could be blamed: its batch's requests fail with a 500 and the
        engine serves the rest. The engine itself is broken (re-raise: the engine thread dies, /health turns 503)
        when it says so (EngineBroken: a tensor-parallel rank gone), or MAX_FAILED_STEPS steps in a row failed."""
        self._failed_steps += 1
        if (isinstance(exc, (EngineBroken, MemoryError)) or self.dead_ranks()
                or self._failed_steps >= MAX_FAILED_STEPS):
            raise exc
        logger.exception("engine step failed: failing the %d request(s) of its batch", len(batch.items))
        self.runner.faults.take()
        message = f"the engine step serving this request failed ({type(exc).__name__}); the server's log has the details"
        return [self._fail(it.request, message) for it in batch.items if not it.request.finished]

    def _fail(self, req: Request, message: str) -> RequestOutput:
        """Finish a request with an error (finish_reason "abort"): its pages go back as an abort's do. Its
        detokenizer is dropped unread: it may be what failed."""
        if not req.finished:
            self.scheduler.finish(req, "abort")
        self._detok.pop(req.request_id, None)
        self.step_runner.release(req)
        self.counters["requests_finished"] += 1
        return RequestOutput(req.request_id, [], "", list(req.output_token_ids), "", True, "abort",
                             req.num_prompt_tokens, error=message, spec_verify_count=req.spec_verify_count,
                             spec_accepted_tokens=req.spec_accepted_tokens,
                             spec_committed_tokens=req.spec_committed_tokens, num_cached_tokens=req.num_cached_tokens)

    def _postprocess(self, batch, result) -> list[RequestOutput]:
        outputs = []
        finishing = []  # (request, reason, its new tokens and logprobs, its place in outputs)
        faults = self.runner.faults
        failed = faults.take()
        for item, sampled in zip(batch.items, result):
            req = item.request
            if req.request_id in failed:  # its own parameters or data broke its part of the step (RequestFaults)
                outputs.append(self._fail(req, failed.pop(req.request_id)))
                continue
            with faults.guard(req.request_id, "postprocessing (stop checks, detokenizing)"):
                self._postprocess_item(item, sampled, outputs, finishing)
        if finishing:
            self._finish([(req, reason) for req, reason, *_ in finishing])
            for req, _, new_ids, new_lps, at in finishing:
                with faults.guard(req.request_id, "detokenizing"):
                    outputs[at] = self._finish_output(req, new_ids, new_lps)
        failed.update(faults.take())
        by_id = {req.request_id: req for req in (it.request for it in batch.items)}
        for rid, message in failed.items():  # its postprocess, or a request a drafter served outside the items
            req = by_id.get(rid) or self.scheduler.find(rid)
            if req is not None:
                outputs = [o for o in outputs if o is not None and o.request_id != rid] + [self._fail(req, message)]
        return [o for o in outputs if o is not None]

    def _postprocess_item(self, item, sampled, outputs: list, finishing: list) -> None:
        req = item.request
        self.scheduler.commit(item, sampled.committed_slots)
        if sampled.num_accepted is not None:
            self._record_verify(req, sampled.num_accepted)
        if not sampled.token_ids:
            return
        if req.first_token_time is None:
            req.first_token_time = time.monotonic()
        if req.prefill_only:
            outputs.append(self._handoff(req, sampled))
            return
        new_ids, new_lps, reason = self._append(req, sampled.token_ids, sampled.logprobs)
        if sampled.num_accepted is not None:
            req.spec_committed_tokens += len(new_ids)
        if reason is not None:
            finishing.append((req, reason, new_ids, new_lps, len(outputs)))
            outputs.append(None)
        else:
            outputs.append(self._output(req, new_ids, new_lps, final=False))

    def _append(self, req: Request, tokens: list[int], logprobs: list[TokenLogprob | None]):
        """Append tokens one at a time, stopping at the first stop condition. Returns what was appended and
        the finish reason (None: the request goes on); the caller finishes the request (`_finish`)."""
        p = req.params
        detok = self._detok.get(req.request_id)
        appended: list[int] = []
        lps: list[TokenLogprob] = []
        for token, lp in zip(tokens, logprobs):
            req.output_token_ids.append(token)
            appended.append(token)
            if lp is not None:
                req.output_logprobs.append(lp)
                lps.append(lp)
            n_out = len(req.output_token_ids)
            can_stop = n_out >= p.min_tokens
            reason = stop_reason = None
            if req.grammar is not None and not req.grammar.accept(token):  # sampled under its mask: a bug
                reason, stop_reason = "abort", f"token {token} is not allowed by the request's grammar"
            elif can_stop and token in p.stop_token_ids:
                reason, stop_reason = "stop", token
            elif (can_stop or req.grammar is not None) and not p.ignore_eos and token in self.eos_token_ids:
                reason = "stop"  # a constrained request: the grammar accepted EOS, so it has ended
            if detok is not None:
                # EOS / stop ids are kept in token_ids but never rendered as text
                hit = detok.add([token], check_stop=can_stop) if reason is None else None
                if hit is not None:
                    reason, stop_reason = "stop", hit
            if reason is None and (n_out >= p.max_tokens or req.num_tokens >= self.max_model_len):
                reason = "length"
            if reason is not None:
                req.stop_reason = stop_reason
                break
        self.counters["generation_tokens"] += len(appended)
        return appended, (lps if p.logprobs is not None else None), reason

    def _finish(self, finishing: list[tuple[Request, str]]) -> None:
        """Finish requests that reached a stop condition (their pages go to the prefix cache with the features of
        any draft extend they deferred: SpecRunner.cache_payloads)."""
        for req, reason in finishing:
            self.scheduler.finish(req, reason)

    def _record_verify(self, req: Request, num_accepted: int) -> None:
        req.spec_verify_count += 1
        req.spec_accepted_tokens += num_accepted
        self.spec_stats.record(num_accepted)


    def _output(self, req: Request, new_ids, new_lps, final: bool) -> RequestOutput:
        detok = self._detok.get(req.request_id)
        new_text = detok.take(final) if detok else ""
        text = detok.text if detok else ""
        return RequestOutput(req.request_id, new_ids, new_text, list(req.output_token_ids), text,
                             final, req.finish_reason if final else None, req.num_prompt_tokens,
                             new_lps, req.stop_reason, spec_verify_count=req.spec_verify_count,
                             spec_accepted_tokens=req.spec_accepted_tokens,
                             spec_committed_tokens=req.spec_committed_tokens,
                             num_cached_tokens=req.num_cached_tokens)

    def _finish_output(self, req: Request, new_ids, new_lps) -> RequestOutput:
        out = self._output(req, new_ids, new_lps, final=True)
        self._detok.pop(req.request_id, None)
        self.step_runner.release(req)
        self.counters["requests_finished"] += 1
        return out
