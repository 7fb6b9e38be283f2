"""Request-level value types shared by every layer: sampling params, requests, outputs.

No torch here: the scheduler and the router import this module.
"""
from __future__ import annotations

import contextlib
import enum
import itertools
import logging
import math
from dataclasses import dataclass, field

logger = logging.getLogger(__name__)

# structured-output constraint kinds (specpd.grammar.constraint, which re-exports them as KINDS): defined here,
# the lowest layer, so SamplingParams.validate checks a kind without importing the grammar package
CONSTRAINT_KINDS = ("json_schema", "json_object", "regex", "choice", "grammar")
# what torch.Generator.manual_seed takes: a 64-bit seed, signed or unsigned (negative ones wrap)
SEED_MIN, SEED_MAX = -(1 << 63), (1 << 64) - 1
SAMPLING_EPS = 1e-5  # a temperature below this samples greedily
LOGIT_BIAS_LIMIT = 100.0  # OpenAI's range for a logit_bias value: [-100, 100]


class InvalidRequest(ValueError):
    """A client error. `field` names the offending request field (server -> HTTP 400)."""

    def __init__(self, field: str, message: str):
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # <= 0 disables
    min_p: float = 0.0
    seed: int | None = None
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    min_tokens: int = 0
    logprobs: int | None = None  # None: no logprobs; k >= 0: chosen token + top-k
    skip_special_tokens: bool = True
    # structured output (specpd.grammar): kind in CONSTRAINT_KINDS, spec the text it compiles from
    constraint_kind: str | None = None
    constraint_spec: str = ""
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias added to its logit), OpenAI's logit_bias

    @property
    def greedy(self) -> bool:
        """Argmax decoding: temperature 0 (below SAMPLING_EPS, where dividing by it overflows: vLLM's rule) or top_k 1."""
        return self.temperature < SAMPLING_EPS or self.top_k == 1

    def validate(self) -> "SamplingParams":
        if not isinstance(self.max_tokens, int) or self.max_tokens <= 0:
            raise InvalidRequest("max_tokens", f"must be a positive integer, got {self.max_tokens!r}")
        if not _finite(self.temperature) or self.temperature < 0:
            raise InvalidRequest("temperature", f"must be >= 0, got {self.temperature!r}")
        if not _finite(self.top_p) or not 0.0 < self.top_p <= 1.0:
            raise InvalidRequest("top_p", f"must be in (0, 1], got {self.top_p!r}")
        if not isinstance(self.top_k, int) or self.top_k < -1:
            raise InvalidRequest("top_k", f"must be -1 (disabled) or a positive integer, got {self.top_k!r}")
        if not _finite(self.min_p) or not 0.0 <= self.min_p <= 1.0:
            raise InvalidRequest("min_p", f"must be in [0, 1], got {self.min_p!r}")
        if not _finite(self.repetition_penalty) or self.repetition_penalty <= 0:
            raise InvalidRequest("repetition_penalty", f"must be > 0, got {self.repetition_penalty!r}")
        for name in ("frequency_penalty", "presence_penalty"):
            value = getattr(self, name)
            if not _finite(value) or not -2.0 <= value <= 2.0:
                raise InvalidRequest(name, f"must be in [-2, 2], got {value!r}")
        if not isinstance(self.min_tokens, int) or self.min_tokens < 0:
            raise InvalidRequest("min_tokens", f"must be >= 0, got {self.min_tokens!r}")
        if self.min_tokens > self.max_tokens:
            raise InvalidRequest("min_tokens", f"({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})")
        if self.logprobs is not None and (not isinstance(self.logprobs, int) or not 0 <= self.logprobs <= 20):
            raise InvalidRequest("logprobs", f"must be an integer in [0, 20], got {self.logprobs!r}")
        if self.seed is not None and (not isinstance(self.seed, int) or isinstance(self.seed, bool)
                                      or not SEED_MIN <= self.seed <= SEED_MAX):
            raise InvalidRequest("seed", f"must be an integer in [-2^63, 2^64 - 1], got {self.seed!r}")
        for token_id, bias in self.logit_bias:
            if not isinstance(token_id, int) or isinstance(token_id, bool) or token_id < 0:
                raise InvalidRequest("logit_bias", f"keys must be token ids (non-negative integers), got {token_id!r}")
            if not _finite(bias) or not -LOGIT_BIAS_LIMIT <= bias <= LOGIT_BIAS_LIMIT:
                raise InvalidRequest("logit_bias", f"values must be numbers in [-100, 100], got {bias!r} for token "
                                                   f"{token_id}")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise InvalidRequest("stop", "must be non-empty strings")
        if any(not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            raise InvalidRequest("stop_token_ids", "must be non-negative integers")
        if self.constraint_kind is not None:
            if self.constraint_kind not in CONSTRAINT_KINDS or not isinstance(self.constraint_spec, str):
                raise InvalidRequest("constraint_kind", f"must be one of {', '.join(CONSTRAINT_KINDS)}, got "
                                                      f"{self.constraint_kind!r}")
            if self.ignore_eos:
                raise InvalidRequest("ignore_eos", "cannot be combined with a structured-output constraint: "
                                                   "the grammar decides where the output ends")
        return self

    @property
    def needs_penalties(self) -> bool:
        return (self.repetition_penalty != 1.0 or self.frequency_penalty != 0.0
                or self.presence_penalty != 0.0)

    @property
    def adjusts_logits(self) -> bool:
        """The distribution is not the raw logits' (penalties or a logit bias): no argmax-of-raw-logits shortcut."""
        return self.needs_penalties or bool(self.logit_bias)


def _finite(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


class EngineBroken(RuntimeError):
    """A fault of the engine itself, not of any request (a tensor-parallel rank gone): it cannot step again."""


class RequestFaults:
    """Failures that one request's own parameters or data cause inside a batched step: its sampling row, its
    generator, its grammar, its drafter, its detokenizer. Each such site runs its per-request work under
    `guard(request_id, what)`, with a harmless value in place for the rest of the step, so the batch goes on;
    at the end of the step the engine finishes every failed request with the error (`take`). The client hears
    what failed, the log has the traceback; no other request is touched."""

    def __init__(self):
        self.failed: dict[str, str] = {}  # request id -> the message its client gets

    @contextlib.contextmanager
    def guard(self, request_id: str, what: str):
        try:
            yield
        except Exception as exc:  # noqa: BLE001 - one request's fault, never the engine's
            logger.exception("request %s failed in %s", request_id, what)
            self.failed.setdefault(request_id, f"the request failed in {what} ({type(exc).__name__}); "
                                               f"the server's log has the details")

    def take(self) -> dict[str, str]:
        failed, self.failed = self.failed, {}
        return failed


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class TokenLogprob:
    token_id: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)  # best first


_request_counter = itertools.count()


@dataclass(eq=False)
class Request:
    """One generation request as the scheduler sees it (plain Python, no tensors)."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival: float = 0.0
    status: RequestStatus = RequestStatus.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    output_logprobs: list[TokenLogprob] = field(default_factory=list)
    pages: list[int] = field(default_factory=list)  # req_to_pages
    num_computed_tokens: int = 0  # tokens whose KV is in the pool
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    first_token_time: float | None = None
    spec_verify_count: int = 0  # verify forwards this request took part in
    spec_accepted_tokens: int = 0  # accepted draft tokens (bonus excluded)
    spec_committed_tokens: int = 0  # tokens committed by verify forwards (bonus included, stops applied)
    spec_state: object = None  # the proposer's per-request draft state (owned by the runner)
    prefill_only: bool = False  # PD prefill role: stop after the handoff token y0, keep the pages
    handoff_hidden: list | None = None  # PD prefill, draft-on-decode-only: the prompt's target features
    sampler_state: object = None  # PD prefill: the request generator's state after y0 (seeded sampling)
    grammar: object = None  # structured output: its specpd.grammar RequestGrammar (owned by the engine)
    cache_node: object = None  # the prefix-cache node whose path this request holds (specpd.kv.radix)
    num_cached_tokens: int = 0  # prompt tokens taken from a prefix cache, not computed here
    draft_kv_len: int | None = None  # positions with valid draft KV (None: no draft KV in the pages)
    # a prefix-cache hit whose pages lack draft KV from `start` on: (start, the target features to build it from),
    # for the spec runner to defer as the prompt's extend (specpd/spec/defer.py)
    cached_draft: tuple | None = None
    kv_pinned: bool = False  # PD prefill: pages being streamed to D while it prefills: never preempted or freed
    # a parallel sample (n > 1) after the first: admitted once `prefix_leader` (the first) has computed the prompt,
    # whose pages it then takes from the prefix cache (Scheduler.share_prefix)
    prefix_leader: "Request | None" = None
    seq_no: int = field(default_factory=lambda: next(_request_counter))

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def finished(self) -> bool:
        return self.status is RequestStatus.FINISHED


@dataclass
class RequestOutput:
    """What one engine step produced for one request (deltas plus running totals)."""

    request_id: str
    new_token_ids: list[int]
    new_text: str
    token_ids: list[int]  # all output tokens so far
    text: str  # all output text so far (stop strings already cut)
    finished: bool
    finish_reason: str | None  # "stop" | "length" | "abort" | None
    num_prompt_tokens: int
    new_logprobs: list[TokenLogprob] | None = None
    stop_reason: str | int | None = None
    error: str | None = None
    spec_verify_count: int = 0
    spec_accepted_tokens: int = 0
    spec_committed_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens whose KV came from a prefix cache (usage.cached_tokens)

    @property
    def spec_accept_length(self) -> float | None:
        """Tokens committed per verify forward, bonus included (tau)."""
        return self.spec_committed_tokens / self.spec_verify_count if self.spec_verify_count else None

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids)


@dataclass
class ScheduledItem:
    request: Request
    start: int  # first position processed this step (== request.num_computed_tokens)
    num_tokens: int  # tokens (KV slots) processed this step
    spec_decode: bool = False  # a draft -> verify round: num_tokens slots hold the root + draft nodes

    @property
    def samples(self) -> bool:
        return self.spec_decode or self.start + self.num_tokens == self.request.num_tokens


@dataclass
class ScheduledBatch:
    items: list[ScheduledItem] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(it.num_tokens for it in self.items)

    def __bool__(self) -> bool:
        return bool(self.items)
