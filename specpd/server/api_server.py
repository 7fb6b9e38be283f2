"""OpenAI-compatible HTTP server around one engine (role "unified": prefill and decode in one process).

A generation request (POST /v1/completions, /v1/chat/completions):
  0. admission.py's middleware: API key (401), body size (413) before a byte is parsed.
  1. The body is parsed into a protocol.py model; every client error is an InvalidRequest, which
     the handler below turns into HTTP 400 {"error": {..., "param": <field>}}. A full queue is 503 with
     Retry-After (--max-queued-requests); prompt text that could never fit the context is 400 untokenized.
  2. The prompt becomes token ids (chat: the model's chat template first); SamplingParams are validated.
     Parsing, templating, tokenizing and logprob detokenizing run in worker threads, never on the loop.
  3. AsyncEngine.submit hands it to the engine thread; the engine's own refusal (prompt + max_tokens
     over the context) comes back as InvalidRequest -> 400.
  4. stream=true: SSE chunks as outputs arrive, then `data: [DONE]`. stream=false: the final body,
     while a watcher listens for the client hanging up.
  5. A client that leaves early (either mode) gets its request aborted, so its KV pages are freed.
Other routes: GET /v1/models, /health, /metrics (Prometheus), /server_info (also /get_server_info, with
SGLang's `internal_states: [{"avg_spec_accept_length": tau}]` for its benchmark client).
"""
from __future__ import annotations

import asyncio
import json
import logging
import os
import time
import uuid
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ValidationError
from starlette.background import BackgroundTask
from starlette.exceptions import HTTPException as StarletteHTTPException

from specpd.core import InvalidRequest, RequestOutput, SamplingParams
from specpd.disagg.bootstrap import BootstrapUnreachable  # stdlib only, like this module's other imports
from specpd.admission import DEFAULT_MAX_REQUEST_BYTES, Admission, error_body, max_prompt_chars
from specpd.machine import huge_pages_status
from specpd.server.async_engine import AsyncEngine, EngineDeadError, QueueFullError, RequestStream
from specpd.server.metrics import ServerMetrics
from specpd.server.protocol import ChatCompletionRequest, CompletionRequest, check_common, field_errors
from specpd.server.sample_streams import collect, merged, nth_sample
from specpd.server.responses import SSE_DONE, ChatFormatter, CompletionFormatter, merged_usage, sse

logger = logging.getLogger(__name__)

ROUTER_FIELDS_BYTES = 1024  # room for bootstrap_host / _port / _room: a body the router took is not P's 413
CLIENT_CLOSED_REQUEST = 499  # nginx's status for "the client hung up first"; nobody reads it


def create_app(engine, role: str = "unified", engine_priority: str = "normal",
               max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES, max_queued_requests: int | None = None,
               api_key: str | None = None, engine_thread=None,
               served_model_names: tuple[str, ...] | list[str] | None = None) -> FastAPI:
    """An app serving `engine` (an LLMEngine, or anything with its interface). The engine thread
    starts with the app's lifespan and stops with it. `api_key` guards /v1/* (PD workers sit behind the
    router and take none); `max_queued_requests` None: no limit. `engine_thread`: the EngineThread `engine` was
    built on, to step it there (None: a thread of its own). `served_model_names`: the names requests may give as
    `model` (vLLM's and SGLang's --served-model-name); the first is the one responses carry (None: --model's)."""
    served_model_names = tuple(served_model_names or ()) or (engine.model_name,)
    metrics = ServerMetrics(lambda: async_engine.stats(), served_model_names[0])
    async_engine = AsyncEngine(engine, metrics, priority=engine_priority, max_queued=max_queued_requests,
                               thread=engine_thread)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        async_engine.start()
        try:
            yield
        finally:
            async_engine.stop()
            if hasattr(engine, "close"):  # PD workers: sockets, bootstrap server, transfer backend
                engine.close()

    app = FastAPI(title="specpd", lifespan=lifespan)
    if role in ("prefill", "decode"):  # the router re-encodes compactly (no \u escapes) and adds its fields
        max_request_bytes += ROUTER_FIELDS_BYTES
    app.add_middleware(Admission, max_request_bytes=max_request_bytes, api_key=api_key,
                       on_refused=metrics.observe_rejected)
    app.state.engine = async_engine
    if hasattr(engine, "stages"):  # PD workers: the TTFT breakdown per stage (disagg/timeline.py)
        from specpd.disagg.timeline import StageCollector
        metrics.registry.register(StageCollector(engine.stages, served_model_names[0]))
    server = _Handlers(engine, async_engine, metrics, role, served_model_names)

    app.post("/v1/completions")(server.completions)
    app.post("/v1/chat/completions")(server.chat_completions)
    app.get("/v1/models")(server.models)
    app.get("/health")(server.health)
    app.get("/metrics")(server.metrics)
    app.get("/server_info")(server.server_info)
    app.get("/get_server_info")(server.server_info)  # SGLang's older name; its clients ask either
    app.api_route("/flush_cache", methods=["GET", "POST"])(server.flush_cache)  # SGLang's name

    @app.exception_handler(InvalidRequest)
    async def invalid_request(_: Request, exc: InvalidRequest):
        metrics.observe_rejected(exc.field)
        return JSONResponse(error_body(str(exc), exc.field, 400), status_code=400)

    @app.exception_handler(RequestValidationError)
    async def schema_error(request: Request, exc: RequestValidationError):
        return await invalid_request(request, field_errors(list(exc.errors())))

    @app.exception_handler(QueueFullError)
    async def queue_full(_: Request, exc: QueueFullError):
        metrics.observe_rejected("queue")
        return JSONResponse(error_body(str(exc), None, 503, "server_error"), status_code=503,
                            headers={"Retry-After": str(exc.retry_after_s)})

    @app.exception_handler(BootstrapUnreachable)
    async def bad_gateway(_: Request, exc: BootstrapUnreachable):  # D could not reach P's bootstrap server
        return JSONResponse(error_body(str(exc), None, 502, "server_error"), status_code=502)

    @app.exception_handler(EngineDeadError)
    async def engine_dead(_: Request, exc: EngineDeadError):
        return JSONResponse(error_body(str(exc), None, 503, "server_error"), status_code=503)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, exc: StarletteHTTPException):
        return JSONResponse(error_body(str(exc.detail), None, exc.status_code,
                                       "not_found_error" if exc.status_code == 404 else "invalid_request_error"),
                            status_code=exc.status_code, headers=getattr(exc, "headers", None))

    @app.exception_handler(Exception)
    async def server_error(request: Request, exc: Exception):
        # the client hears that it failed and where to look; what failed (the exception) stays in the log
        logger.error("unhandled error in %s %s", request.method, request.url.path, exc_info=exc)
        return JSONResponse(error_body(f"internal error ({type(exc).__name__}) in {request.url.path}; the server's "
                                       f"log has the details", None, 500, "server_error"), status_code=500)

    return app


class _Handlers:
    def __init__(self, engine, async_engine: AsyncEngine, metrics: ServerMetrics, role: str,
                 served_model_names: tuple[str, ...]):
        self.engine = engine
        self.tokenizer = engine.tokenizer
        self.served_model_names = served_model_names  # a request may name any; responses carry the first
        self.model_name = served_model_names[0]
        self.async_engine = async_engine
        self.metrics_registry = metrics
        self.role = role
        self.started = int(time.time())
        self.max_prompt_chars = max_prompt_chars(self.tokenizer, engine.max_model_len)
        spec = getattr(getattr(engine, "config", None), "spec", None)
        # usage always carries the acceptance fields where this server's requests may speculate (P only prefills)
        self.speculative = spec is not None and spec.enabled and role != "prefill"

    # -- generation ------------------------------------------------------------------------
    async def completions(self, raw: Request):
        req = await _parse(raw, CompletionRequest)
        self.async_engine.check_queue()
        self._check_common(req)
        prompt = req.single_prompt()
        params = req.to_sampling_params()
        await self._compile_constraint(req)
        if isinstance(prompt, str):
            self._check_prompt_chars("prompt", len(prompt))
            prompt_ids = await asyncio.to_thread(self.tokenizer.encode, prompt)
        else:
            prompt_ids = list(prompt)
        request_id = f"cmpl-{uuid.uuid4().hex}"
        formatters = [CompletionFormatter(request_id, self.model_name, self._token_text_for(req), params.logprobs,
                                          req.include_usage, self.speculative, index=i) for i in range(req.n or 1)]
        return await self._generate(raw, prompt_ids, params, formatters, bool(req.stream))

    async def chat_completions(self, raw: Request):
        req = await _parse(raw, ChatCompletionRequest)
        self.async_engine.check_queue()
        self._check_common(req)
        messages = req.template_messages()
        self._check_prompt_chars("messages", sum(len(m["content"]) for m in messages))
        prompt_ids = await asyncio.to_thread(self._chat_prompt_ids, messages, req.add_generation_prompt)
        params = req.to_sampling_params(default_max_tokens=self._room_left(len(prompt_ids)))
        await self._compile_constraint(req)
        tool = req.tool_call()
        request_id = f"chatcmpl-{uuid.uuid4().hex}"
        formatters = [ChatFormatter(request_id, self.model_name, self._token_text_for(req), params.logprobs,
                                    req.include_usage, self.speculative, tool_choice=tool[1] if tool else None, index=i)
                      for i in range(req.n or 1)]
        return await self._generate(raw, prompt_ids, params, formatters, bool(req.stream))

    def _check_common(self, req) -> None:
        check_common(req, self.served_model_names)
        if (req.n or 1) > 1 and self.role != "unified":  # the router sends P and D one sample at a time
            raise InvalidRequest("n", f"a {self.role} server takes n=1 only (the router splits n > 1)")

    async def _compile_constraint(self, req) -> None:
        """Structured output: compile the constraint (cached) in a worker thread, so a slow schema never
        blocks the event loop or the engine step; a bad one is a 400 naming its field."""
        constraint = req.constraint()
        engine = self.engine if hasattr(type(self.engine), "grammar") else getattr(self.engine, "engine", None)
        if constraint is not None and engine is not None:
            await asyncio.to_thread(lambda: engine.grammar.compile(constraint.kind, constraint.spec, constraint.field))

    def _chat_prompt_ids(self, messages: list[dict], add_generation_prompt: bool) -> list[int]:
        try:
            text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt)
        except Exception as exc:  # noqa: BLE001 - jinja TemplateError, or a model without a template
            raise InvalidRequest("messages", f"the chat template could not render them: {exc}") from None
        return self.tokenizer.encode(text)

    def _check_prompt_chars(self, field: str, num_chars: int) -> None:
        """Refuse, untokenized, text that holds more tokens than the context whatever it says."""
        if self.max_prompt_chars is not None and num_chars > self.max_prompt_chars:
            raise InvalidRequest(field, f"{num_chars} characters of prompt text cannot fit the context of "
                                        f"{self.engine.max_model_len} tokens (at most {self.max_prompt_chars} "
                                        f"characters could)")

    def _room_left(self, num_prompt_tokens: int) -> int:
        """Chat's default max_tokens: whatever the context and the KV cache leave after the prompt."""
        stats = self.async_engine.stats()
        capacity = self.engine.max_model_len
        if "page_size" in stats:
            capacity = min(capacity, stats["total_pages"] * stats["page_size"])
        return max(1, capacity - num_prompt_tokens)

    def _token_text_for(self, req):
        return _token_id_text if req.return_tokens_as_token_ids else self._token_text

    def _token_text(self, token_id: int) -> str:
        if self.tokenizer is None:  # a checkpoint without a tokenizer (token-id prompts): vLLM's id form
            return _token_id_text(token_id)
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    async def _generate(self, raw: Request, prompt_ids: list[int], params: SamplingParams,
                        formatters: list[CompletionFormatter] | list[ChatFormatter], stream: bool) -> Response:
        """One request's parallel samples (n = len(formatters), one choice each; n > 1 on a unified server only):
        each is its own engine request, the ones after the first sharing its prompt's KV pages."""
        request_id = formatters[0].id
        if self.role in ("prefill", "decode"):
            await self._bootstrap(raw, request_id)
            stream = stream and self.role == "decode"  # P answers once the KV is handed off
        ids = [request_id] if len(formatters) == 1 else [f"{request_id}-{i}" for i in range(len(formatters))]
        streams: list[RequestStream] = []
        try:
            for i, child in enumerate(ids):
                streams.append(await self.async_engine.submit(child, prompt_ids, nth_sample(params, i),
                                                              follows=ids[0] if i else None))
        except InvalidRequest as err:
            self._abort(ids)
            if err.field == "prompt" and isinstance(formatters[0], ChatFormatter):  # chat's prompt is its messages
                raise InvalidRequest("messages", err.message) from None
            raise
        except BaseException:
            self._abort(ids)
            raise
        if stream:
            # The background task runs after the response ends however it ends, including a
            # disconnect before the first chunk (when the generator's finally never runs).
            return StreamingResponse(self._sse(streams, formatters), media_type="text/event-stream",
                                     background=BackgroundTask(self._abort, ids))
        outputs = await collect(raw, streams, self._abort)
        if outputs is None:
            return Response(status_code=CLIENT_CLOSED_REQUEST)
        if error := next((o[-1].error for o in outputs if o[-1].error), None):
            return JSONResponse(error_body(error, None, 500, "server_error"), status_code=500)
        bodies = [(f.response(o) if f.top_logprobs is None  # logprobs: decodes each token
                   else await asyncio.to_thread(f.response, o)) for f, o in zip(formatters, outputs)]
        body = bodies[0]
        if len(bodies) > 1:
            body["choices"] = [b["choices"][0] for b in bodies]
            body["usage"] = merged_usage([o[-1] for o in outputs], formatters[0].speculative)
        return JSONResponse(body)

    def _abort(self, request_ids: list[str]) -> None:
        for request_id in request_ids:
            self.async_engine.abort(request_id)

    async def _bootstrap(self, raw: Request, request_id: str) -> None:
        """PD roles: read the router's bootstrap fields; D also finds P and checks its config (400 on mismatch)."""
        from specpd.disagg.worker import BootstrapInfo
        info = BootstrapInfo.from_body(await asyncio.to_thread(json.loads, await raw.body()))  # off the loop
        if self.role == "decode":
            await asyncio.to_thread(self.engine.bootstrap, request_id, info)
        else:
            self.engine.expect(request_id, info)

    async def _sse(self, streams: list[RequestStream], formatters):
        """The parallel samples' chunks as they come, each under its choice index; then an error event if one
        failed, else the usage chunk (include_usage); then [DONE]."""
        finals: list[RequestOutput | None] = [None] * len(streams)
        try:
            async for i, out in merged(streams):
                finals[i] = out
                f = formatters[i]
                chunks = (f.chunks(out) if f.top_logprobs is None  # logprobs: decodes tokens
                          else await asyncio.to_thread(f.chunks, out))
                for chunk in chunks:
                    yield sse(chunk)
            if error := next((o.error for o in finals if o is not None and o.error), None):
                yield sse(error_body(error, None, 500, "server_error"))
            elif formatters[0].include_usage and all(o is not None for o in finals):
                yield sse(formatters[0].usage_chunk(finals))
        except EngineDeadError as exc:
            yield sse(error_body(str(exc), None, 503, "server_error"))
        finally:
            for s in streams:
                if not s.finished:  # the client went away (this generator was cancelled)
                    self.async_engine.abort(s.request_id)
        yield SSE_DONE

    # -- info ------------------------------------------------------------------------------
    async def models(self):
        root = getattr(self.engine.config, "model", self.model_name)
        return {"object": "list", "data": [{
            "id": name, "object": "model", "created": self.started, "owned_by": "specpd", "root": root,
            "max_model_len": self.engine.max_model_len} for name in self.served_model_names]}

    async def health(self):
        if dead := self.async_engine.dead_ranks():
            return JSONResponse(error_body(f"tensor-parallel rank(s) {dead} of the engine exited: the server "
                                           f"cannot generate", None, 503, "server_error"), status_code=503)
        if not self.async_engine.alive:
            return JSONResponse(error_body(self.async_engine.why_dead(), None, 503, "server_error"), status_code=503)
        return {"status": "ok"}

    async def metrics(self):
        content, content_type = self.metrics_registry.render()
        return Response(content, media_type=content_type)

    async def flush_cache(self):
        """Drop every cached KV page no request holds (pages in use stay)."""
        flushed = await self.async_engine.call(lambda engine: engine.flush_cache())
        return {"flushed_pages": flushed, "free_pages": self.async_engine.stats().get("free_pages")}

    async def server_info(self):
        stats = self.async_engine.stats()
        # SGLang's shape, read by its bench_serving: tau = tokens committed per verify forward, bonus
        # included, engine-wide since start (None before the first verify or without speculation)
        internal = {"avg_spec_accept_length": stats.get("spec_accept_length"),
                    "spec_verify_count": stats.get("spec_verify_count", 0)}
        spec = self.engine.config.spec
        # the shape and drafters in force (the config holds None where the defaults apply)
        resolved = {"algorithm": spec.speculative_algorithm, "hybrid": spec.hybrid, "num_steps": spec.num_steps,
                    "topk": spec.topk, "num_draft_tokens": spec.num_draft_tokens} if spec.enabled else None
        return {**stats, "role": self.role, "model": self.model_name, "max_model_len": self.engine.max_model_len,
                "config": self.engine.config.to_dict(), "speculative": resolved, "pid": os.getpid(),
                "huge_pages": huge_pages_status(),
                "free_pages": stats.get("free_pages"), "total_pages": stats.get("total_pages"),
                "engine_alive": self.async_engine.alive, "num_queued": self.async_engine.num_queued,
                **({"pd_stages": self.engine.stages.summary()} if hasattr(self.engine, "stages") else {}),
                "internal_states": [internal]}


def _token_id_text(token_id: int) -> str:
    return f"token_id:{token_id}"


async def _parse(raw: Request, model: type[BaseModel]):
    body = await raw.body()  # at most --max-request-bytes (admission.py)
    try:
        return await asyncio.to_thread(model.model_validate_json, body)
    except ValidationError as err:
        raise field_errors(err) from None
