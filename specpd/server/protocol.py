"""OpenAI-compatible request shapes for /v1/completions and /v1/chat/completions.

A request body passes three checks, each of which ends in HTTP 400 naming the field:
  1. JSON types: the pydantic models below (`field_errors` turns a ValidationError into InvalidRequest).
  2. Server-level rules: `check_model`, n / echo / best_of / stream_options (`check_common`).
  3. Sampling values: `to_sampling_params()` builds SamplingParams and runs its `validate()`.
The engine adds the last check (prompt + max_tokens within the context) in `add_request`.

Every field is Optional so that clients which send explicit `null`s get the OpenAI defaults.
No torch here.
"""
from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, ValidationError

from specpd.core import InvalidRequest, SamplingParams
from specpd.grammar.constraint import Constraint, parse_constraint
from specpd.grammar.tools import ToolChoice, tool_constraint

DEFAULT_COMPLETION_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
MAX_LOGPROBS = 20
MAX_N = 128  # parallel samples per request (OpenAI's limit)


class StreamOptions(BaseModel):
    include_usage: bool | None = False


class _GenerationRequest(BaseModel):
    """Fields shared by both endpoints: OpenAI's, then the vLLM/SGLang-style extensions."""

    model_config = ConfigDict(extra="ignore")  # clients send fields we do not use (user, metadata, ...)

    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    n: int | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    logit_bias: dict[str, float] | None = None  # token id (a JSON key, so a string) -> bias in [-100, 100]
    # extensions
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool | None = None
    min_tokens: int | None = None
    skip_special_tokens: bool | None = None
    return_tokens_as_token_ids: bool | None = None  # vLLM: logprob tokens as "token_id:N"
    # structured outputs (specpd.grammar.constraint checks their shapes, so a 400 names the exact part)
    response_format: Any = None  # OpenAI
    structured_outputs: Any = None  # vLLM
    guided_json: Any = None  # vLLM, older
    guided_regex: Any = None
    guided_choice: Any = None
    guided_grammar: Any = None
    json_schema: Any = None  # SGLang
    regex: Any = None
    ebnf: Any = None

    def constraint(self) -> Constraint | None:
        return parse_constraint({name: getattr(self, name) for name in _CONSTRAINT_FIELDS})

    @property
    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)

    def _sampling_kwargs(self, max_tokens: int) -> dict[str, Any]:
        given = {
            "temperature": self.temperature, "top_p": self.top_p, "top_k": self.top_k,
            "min_p": self.min_p, "seed": self.seed, "repetition_penalty": self.repetition_penalty,
            "frequency_penalty": self.frequency_penalty, "presence_penalty": self.presence_penalty,
            "ignore_eos": self.ignore_eos, "min_tokens": self.min_tokens,
            "skip_special_tokens": self.skip_special_tokens,
        }
        kwargs = {k: v for k, v in given.items() if v is not None}
        kwargs["max_tokens"] = max_tokens
        if self.stop is not None:
            kwargs["stop"] = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)
        if self.stop_token_ids is not None:
            kwargs["stop_token_ids"] = tuple(self.stop_token_ids)
        if self.logit_bias:
            kwargs["logit_bias"] = _logit_bias(self.logit_bias)
        constraint = self.constraint()
        if constraint is not None:
            kwargs["constraint_kind"], kwargs["constraint_spec"] = constraint.kind, constraint.spec
        return kwargs


def _logit_bias(bias: dict[str, float]) -> tuple[tuple[int, float], ...]:
    """OpenAI's {"token id": bias} as (id, bias) pairs; the values' range is SamplingParams.validate's, the
    vocabulary's the engine's."""
    pairs = {}
    for key, value in bias.items():
        try:
            token_id = int(key)
        except ValueError:
            raise InvalidRequest("logit_bias", f"keys must be token ids (integers), got {_short(key)}") from None
        pairs[token_id] = value
    return tuple(sorted(pairs.items()))


_CONSTRAINT_FIELDS = ("response_format", "structured_outputs", "guided_json", "guided_regex", "guided_choice",
                      "guided_grammar", "json_schema", "regex", "ebnf")


class CompletionRequest(_GenerationRequest):
    # A list of strings or of token-id lists is a batch; it is accepted by the schema so that
    # the rejection can say why (see `single_prompt`), rather than a generic type error.
    prompt: str | list[int] | list[str] | list[list[int]]
    logprobs: int | None = None
    echo: bool | None = False
    best_of: int | None = None
    suffix: str | None = None

    def single_prompt(self) -> str | list[int]:
        """The one prompt of this request: a string or a list of token ids (never empty)."""
        prompt = self.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
            if len(prompt) != 1:
                raise InvalidRequest("prompt", f"batched prompts ({len(prompt)} prompts in a list) are not "
                                               "supported; send one request per prompt")
            prompt = prompt[0]
        if len(prompt) == 0:
            raise InvalidRequest("prompt", "must not be empty")
        return prompt

    def to_sampling_params(self) -> SamplingParams:
        max_tokens = DEFAULT_COMPLETION_MAX_TOKENS if self.max_tokens is None else self.max_tokens
        return SamplingParams(logprobs=self.logprobs, **self._sampling_kwargs(max_tokens)).validate()


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: str
    text: str | None = None


# OpenAI's message roles ("function" is its older name for "tool", "developer" its newer one for "system")
CHAT_ROLES = ("system", "developer", "user", "assistant", "tool", "function")


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")  # name, tool_calls, ... are passed to the template
    role: str
    content: str | list[ContentPart] | None = None


class ChatCompletionRequest(_GenerationRequest):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None  # OpenAI's newer name for max_tokens
    logprobs: bool | None = False
    top_logprobs: int | None = None
    add_generation_prompt: bool | None = True  # extension
    tools: Any = None  # with tool_choice "required" or a named function: a constraint (specpd.grammar.tools)
    tool_choice: Any = None

    def tool_call(self) -> tuple[Constraint, ToolChoice] | None:
        return tool_constraint(self.tools, self.tool_choice)

    def constraint(self) -> Constraint | None:
        plain, tool = super().constraint(), self.tool_call()
        if plain is not None and tool is not None:
            raise InvalidRequest(plain.field, "cannot be combined with a forced tool call (tool_choice)")
        return tool[0] if tool is not None else plain

    @property
    def max_tokens_field(self) -> str:
        return "max_completion_tokens" if self.max_completion_tokens is not None else "max_tokens"

    def template_messages(self) -> list[dict[str, Any]]:
        """Messages as plain dicts for the chat template, text parts joined into one string."""
        if not self.messages:
            raise InvalidRequest("messages", "must contain at least one message")
        out = []
        for i, msg in enumerate(self.messages):
            if msg.role not in CHAT_ROLES:
                raise InvalidRequest(f"messages[{i}].role", f"must be one of {', '.join(CHAT_ROLES)}, got "
                                                            f"{_short(msg.role)}")
            content = msg.content
            if isinstance(content, list):
                texts = []
                for part in content:
                    if part.type != "text" or part.text is None:
                        raise InvalidRequest(f"messages[{i}].content",
                                             f"only text content parts are supported, got type {part.type!r}")
                    texts.append(part.text)
                content = "".join(texts)
            out.append({**msg.model_dump(exclude_none=True), "content": content or ""})
        return out

    def to_sampling_params(self, default_max_tokens: int) -> SamplingParams:
        """`default_max_tokens` applies when neither max_tokens field is set: the rest of the context."""
        max_tokens = self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
        if self.top_logprobs is not None and not self.logprobs:
            raise InvalidRequest("top_logprobs", "requires logprobs to be true")
        if self.top_logprobs is not None and not 0 <= self.top_logprobs <= MAX_LOGPROBS:
            raise InvalidRequest("top_logprobs", f"must be an integer in [0, {MAX_LOGPROBS}], "
                                                 f"got {self.top_logprobs!r}")
        logprobs = (self.top_logprobs or 0) if self.logprobs else None
        kwargs = self._sampling_kwargs(default_max_tokens if max_tokens is None else max_tokens)
        try:
            return SamplingParams(logprobs=logprobs, **kwargs).validate()
        except InvalidRequest as err:
            if err.field == "max_tokens" and self.max_tokens_field != "max_tokens":
                raise InvalidRequest(self.max_tokens_field, err.message) from None
            raise


def check_common(req: _GenerationRequest, served_models: tuple[str, ...]) -> None:
    """Rules the server enforces before sampling params: model name (any of the served names), n, echo, stream
    options."""
    if req.model is not None and req.model not in served_models:
        raise InvalidRequest("model", f"the model {_short(req.model)} does not exist; this server serves "
                                      f"{', '.join(map(repr, served_models))}")
    if req.n is not None and not 1 <= req.n <= MAX_N:
        raise InvalidRequest("n", f"must be an integer in [1, {MAX_N}], got {req.n}")
    if req.stream_options is not None and not req.stream:
        raise InvalidRequest("stream_options", "is only allowed when stream is true")
    if isinstance(req, CompletionRequest):
        if req.echo:
            raise InvalidRequest("echo", "echo=true is not supported")
        if req.best_of is not None and req.best_of != 1:
            raise InvalidRequest("best_of", f"only best_of=1 is supported, got {req.best_of}")
        if req.suffix:
            raise InvalidRequest("suffix", "suffix is not supported")


def field_errors(err: ValidationError | list[dict[str, Any]]) -> InvalidRequest:
    """The first pydantic error as an InvalidRequest naming its field (`messages[0].role`)."""
    errors = err.errors() if isinstance(err, ValidationError) else err
    first = errors[0]
    loc = [p for p in first.get("loc", ()) if p != "body"]
    if first.get("type") == "json_invalid":
        ctx = first.get("ctx") or {}
        detail = ctx.get("error", first.get("msg", ""))
        return InvalidRequest("body", f"malformed JSON body: {detail}")
    # A union (str | list[int] | ...) reports one error per member, tagged by an extra loc part.
    field = _format_loc([p for p in loc if not _is_union_tag(p)])
    if not field:
        return InvalidRequest("body", f"the request body must be a JSON object: {first.get('msg')}")
    if any(_is_union_tag(p) for p in loc):
        tags = [next(p for p in e["loc"] if _is_union_tag(p)) for e in errors
                if any(_is_union_tag(p) for p in e["loc"])
                and _format_loc([p for p in e["loc"] if p != "body" and not _is_union_tag(p)]) == field]
        return InvalidRequest(field, f"expected one of {', '.join(dict.fromkeys(tags))} "
                                     f"(got {_short(first.get('input'))})")
    return InvalidRequest(field, f"{first.get('msg', 'invalid value')} (got {_short(first.get('input'))})")


def _is_union_tag(part: Any) -> bool:
    return isinstance(part, str) and (part in ("str", "int", "float", "bool", "ContentPart")
                                      or part.startswith(("list[", "dict[")))


def _format_loc(loc: list[Any]) -> str:
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."

