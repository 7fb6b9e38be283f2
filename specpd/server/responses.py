"""OpenAI-shaped response bodies and stream chunks, built from the engine's RequestOutputs.

One formatter per endpoint, per request:
  - `response(outputs)`: the non-streaming body (choices[0].text | message, logprobs,
    finish_reason, usage) from every output of the request.
  - `chunks(out)`: the stream chunks for one output delta. Chat opens with a {"role"} delta and
    ends with an empty delta carrying finish_reason; completions put finish_reason on the last text.
  - `usage_chunk(out)`: with stream_options.include_usage, a last chunk with empty choices.
`sse()` frames a chunk as `data: {...}\\n\\n`; the stream ends with `SSE_DONE`.
"""
from __future__ import annotations

import json
import math
import time
from typing import Any, Callable

from specpd.core import RequestOutput, TokenLogprob

SSE_DONE = "data: [DONE]\n\n"
_NEG_INF_LOGPROB = -9999.0  # what OpenAI reports for an impossible token (JSON has no -inf)


def sse(payload: dict[str, Any]) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"


def usage(out: RequestOutput, speculative: bool = False) -> dict[str, Any]:
    """speculative: the server speculates, so the acceptance fields are always there (0 verifies, tau null, for a
    request the adaptive policy served in plain steps only: a client measuring tau sees that, not nothing)."""
    body: dict[str, Any] = {"prompt_tokens": out.num_prompt_tokens, "completion_tokens": out.num_output_tokens,
                            "total_tokens": out.num_prompt_tokens + out.num_output_tokens,
                            # OpenAI's field: prompt tokens whose KV came from the prefix cache
                            "prompt_tokens_details": {"cached_tokens": out.num_cached_tokens}}
    if speculative or out.spec_verify_count:
        body.update(spec_verify_count=out.spec_verify_count, spec_accepted_tokens=out.spec_accepted_tokens,
                    spec_accept_length=out.spec_accept_length)
    return body


def merged_usage(finals: list[RequestOutput], speculative: bool = False) -> dict[str, Any]:
    """One usage for a request's parallel samples (their final outputs): the prompt counted once (as OpenAI
    does), completion tokens and the acceptance counts summed, tau over all of them."""
    if len(finals) == 1:
        return usage(finals[0], speculative)
    first = finals[0]
    merged = RequestOutput(first.request_id, [], "", [t for f in finals for t in f.token_ids], "", True, None,
                           first.num_prompt_tokens, spec_verify_count=sum(f.spec_verify_count for f in finals),
                           spec_accepted_tokens=sum(f.spec_accepted_tokens for f in finals),
                           spec_committed_tokens=sum(f.spec_committed_tokens for f in finals),
                           num_cached_tokens=first.num_cached_tokens)
    return usage(merged, speculative)


def _logprob(value: float) -> float:
    return value if math.isfinite(value) else _NEG_INF_LOGPROB


class _Formatter:
    object_name = ""
    chunk_object_name = ""

    def __init__(self, request_id: str, model: str, decode_token: Callable[[int], str],
                 top_logprobs: int | None, include_usage: bool = False, speculative: bool = False, index: int = 0):
        """index: the choice this formatter writes (n > 1: one formatter per parallel sample, one response id)."""
        self.index = index
        self.id = request_id
        self.model = model
        self.created = int(time.time())
        self.decode_token = decode_token
        self.top_logprobs = top_logprobs  # None: logprobs not requested
        self.include_usage = include_usage
        self.speculative = speculative  # usage carries the acceptance fields (`usage`)

    def _envelope(self, obj: str, choices: list[dict[str, Any]]) -> dict[str, Any]:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model, "choices": choices}

    def _chunk(self, choice: dict[str, Any]) -> dict[str, Any]:
        chunk = self._envelope(self.chunk_object_name, [choice])
        if self.include_usage:
            chunk["usage"] = None
        return chunk

    def usage_chunk(self, finals: list[RequestOutput]) -> dict[str, Any]:
        return {**self._envelope(self.chunk_object_name, []), "usage": merged_usage(finals, self.speculative)}

    def _logprobs_of(self, outputs: list[RequestOutput]) -> list[TokenLogprob]:
        return [lp for o in outputs for lp in (o.new_logprobs or [])]


class CompletionFormatter(_Formatter):
    object_name = "text_completion"
    chunk_object_name = "text_completion"

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._text_offset = 0  # characters of token text already reported (logprobs.text_offset)

    def _logprobs(self, lps: list[TokenLogprob]) -> dict[str, Any] | None:
        if self.top_logprobs is None:
            return None
        tokens, token_logprobs, top, offsets = [], [], [], []
        for lp in lps:
            token = self.decode_token(lp.token_id)
            tokens.append(token)
            token_logprobs.append(_logprob(lp.logprob))
            entries = {self.decode_token(t): _logprob(v) for t, v in lp.top[:self.top_logprobs]}
            entries.setdefault(token, _logprob(lp.logprob))
            top.append(entries)
            offsets.append(self._text_offset)
            self._text_offset += len(token)
        return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top, "text_offset": offsets}

    def _choice(self, text: str, lps: list[TokenLogprob], out: RequestOutput) -> dict[str, Any]:
        return {"index": self.index, "text": text, "logprobs": self._logprobs(lps),
                "finish_reason": out.finish_reason if out.finished else None,
                "stop_reason": out.stop_reason if out.finished else None}

    def response(self, outputs: list[RequestOutput]) -> dict[str, Any]:
        last = outputs[-1]
        body = self._envelope(self.object_name, [self._choice(last.text, self._logprobs_of(outputs), last)])
        body["usage"] = usage(last, self.speculative)
        return body

    def chunks(self, out: RequestOutput) -> list[dict[str, Any]]:
        lps = out.new_logprobs or []
        if not (out.new_text or out.finished or (lps and self.top_logprobs is not None)):
            return []
        return [self._chunk(self._choice(out.new_text, lps, out))]


class ChatFormatter(_Formatter):
    object_name = "chat.completion"
    chunk_object_name = "chat.completion.chunk"

    def __init__(self, *args, tool_choice=None, **kwargs):
        """tool_choice: a specpd.grammar.tools.ToolChoice when the output is a forced tool call."""
        super().__init__(*args, **kwargs)
        self._sent_role = False
        self.tool_choice = tool_choice
        self._tool_stream = None  # specpd.grammar.tools.ToolCallStream: streamed tool_calls deltas

    def _entry(self, token_id: int, logprob: float) -> dict[str, Any]:
        token = self.decode_token(token_id)
        return {"token": token, "logprob": _logprob(logprob), "bytes": list(token.encode("utf-8"))}

    def _logprobs(self, lps: list[TokenLogprob]) -> dict[str, Any] | None:
        if self.top_logprobs is None:
            return None
        return {"content": [{**self._entry(lp.token_id, lp.logprob),
                             "top_logprobs": [self._entry(t, v) for t, v in lp.top[:self.top_logprobs]]}
                            for lp in lps]}

    def response(self, outputs: list[RequestOutput]) -> dict[str, Any]:
        last = outputs[-1]
        message, finish_reason = self._message(last.text, last.finish_reason)
        choice = {"index": self.index, "message": message,
                  "logprobs": self._logprobs(self._logprobs_of(outputs)),
                  "finish_reason": finish_reason, "stop_reason": last.stop_reason}
        return {**self._envelope(self.object_name, [choice]), "usage": usage(last, self.speculative)}

    def _delta_chunk(self, delta: dict[str, Any], logprobs: Any = None,
                     finish_reason: str | None = None, stop_reason: Any = None) -> dict[str, Any]:
        choice = {"index": self.index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}
        if finish_reason is not None:
            choice["stop_reason"] = stop_reason
        return self._chunk(choice)

    def chunks(self, out: RequestOutput) -> list[dict[str, Any]]:
        chunks = []
        if not self._sent_role:
            self._sent_role = True
            chunks.append(self._delta_chunk({"role": "assistant", "content": ""}))
        lps = out.new_logprobs or []
        finish_reason = out.finish_reason
        if self.tool_choice is not None:  # like OpenAI: the call's opening delta, then argument fragments
            if self._tool_stream is None:
                from specpd.grammar.tools import ToolCallStream
                self._tool_stream = ToolCallStream(self.tool_choice)
            calls = self._tool_stream.feed(out.new_text)
            if calls:
                chunks.append(self._delta_chunk({"tool_calls": calls}))
            if out.finished and finish_reason == "stop" and not self.tool_choice.named:
                finish_reason = "tool_calls"
        elif out.new_text or (lps and self.top_logprobs is not None):
            chunks.append(self._delta_chunk({"content": out.new_text}, self._logprobs(lps)))
        if out.finished:
            chunks.append(self._delta_chunk({}, finish_reason=finish_reason, stop_reason=out.stop_reason))
        return chunks

    def _message(self, text: str, finish_reason: str | None) -> tuple[dict[str, Any], str | None]:
        """The assistant message: a forced tool call that completed is `tool_calls`, else the text."""
        if self.tool_choice is not None and finish_reason == "stop":
            from specpd.grammar.tools import tool_calls
            calls = tool_calls(text, self.tool_choice)
            if calls is not None:  # like OpenAI: a forced named function finishes with "stop"
                return ({"role": "assistant", "content": None, "tool_calls": calls},
                        "stop" if self.tool_choice.named else "tool_calls")
        return {"role": "assistant", "content": text}, finish_reason
