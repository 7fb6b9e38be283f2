"""OpenAI-compatible HTTP server around one engine (role "unified": prefill and decode in one process).

A generation request (POST /v1/completions, /v1/chat/completions):
  1. The body is parsed into a protocol.py model; every client error is an InvalidRequest, which
     the handler below turns into HTTP 400 {"error": {..., "param": <field>}}.
  2. The prompt becomes token ids (chat: the model's chat template first); SamplingParams are validated.
  3. AsyncEngine.submit hands it to the engine thread; the engine's own refusal (prompt + max_tokens
     over the context) comes back as InvalidRequest -> 400.
  4. stream=true: SSE chunks as outputs arrive, then `data: [DONE]`. stream=false: the final body,
     while a watcher listens for the client hanging up.
  5. A client that leaves early (either mode) gets its request aborted, so its KV pages are freed.
Other routes: GET /v1/models, /health, /metrics (Prometheus), /server_info.
"""
from __future__ import annotations

import asyncio
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
from specpd.server.async_engine import AsyncEngine, EngineDeadError, RequestStream
from specpd.server.metrics import ServerMetrics
from specpd.server.protocol import ChatCompletionRequest, CompletionRequest, check_common, field_errors
from specpd.server.responses import SSE_DONE, ChatFormatter, CompletionFormatter, error_body, sse

logger = logging.getLogger(__name__)

CLIENT_CLOSED_REQUEST = 499  # nginx's status for "the client hung up first"; nobody reads it


def create_app(engine, role: str = "unified", engine_priority: str = "normal") -> FastAPI:
    """An app serving `engine` (an LLMEngine, or anything with its interface). The engine thread
    starts with the app's lifespan and stops with it."""
    metrics = ServerMetrics(lambda: async_engine.stats(), engine.model_name)
    async_engine = AsyncEngine(engine, metrics, priority=engine_priority)

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
    app.state.engine = async_engine
    server = _Handlers(engine, async_engine, metrics, role)

    app.post("/v1/completions")(server.completions)
    app.post("/v1/chat/completions")(server.chat_completions)
    app.get("/v1/models")(server.models)
    app.get("/health")(server.health)
    app.get("/metrics")(server.metrics)
    app.get("/server_info")(server.server_info)

    @app.exception_handler(InvalidRequest)
    async def invalid_request(_: Request, exc: InvalidRequest):
        metrics.observe_rejected(exc.field)
        return JSONResponse(error_body(str(exc), exc.field, 400), status_code=400)

    @app.exception_handler(RequestValidationError)
    async def schema_error(request: Request, exc: RequestValidationError):
        return await invalid_request(request, field_errors(list(exc.errors())))

    @app.exception_handler(EngineDeadError)
    async def engine_dead(_: Request, exc: EngineDeadError):
        return JSONResponse(error_body(str(exc), None, 503, "server_error"), status_code=503)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, exc: StarletteHTTPException):
        return JSONResponse(error_body(str(exc.detail), None, exc.status_code,
                                       "not_found_error" if exc.status_code == 404 else "invalid_request_error"),
                            status_code=exc.status_code, headers=getattr(exc, "headers", None))

    @app.exception_handler(Exception)
    async def server_error(_: Request, exc: Exception):
        logger.exception("unhandled error")
        return JSONResponse(error_body(f"internal error: {exc!r}", None, 500, "server_error"), status_code=500)

    return app


class _Handlers:
    def __init__(self, engine, async_engine: AsyncEngine, metrics: ServerMetrics, role: str):
        self.engine = engine
        self.tokenizer = engine.tokenizer
        self.model_name = engine.model_name
        self.async_engine = async_engine
        self.metrics_registry = metrics
        self.role = role
        self.started = int(time.time())

    # -- generation ------------------------------------------------------------------------
    async def completions(self, raw: Request):
        req = await _parse(raw, CompletionRequest)
        check_common(req, self.model_name)
        prompt = req.single_prompt()
        params = req.to_sampling_params()
        prompt_ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        formatter = CompletionFormatter(f"cmpl-{uuid.uuid4().hex}", self.model_name, self._token_text_for(req),
                                        params.logprobs, req.include_usage)
        return await self._generate(raw, prompt_ids, params, formatter, bool(req.stream))

    async def chat_completions(self, raw: Request):
        req = await _parse(raw, ChatCompletionRequest)
        check_common(req, self.model_name)
        messages = req.template_messages()
        try:
            text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=req.add_generation_prompt)
        except Exception as exc:  # noqa: BLE001 - jinja TemplateError, or a model without a template
            raise InvalidRequest("messages", f"the chat template could not render them: {exc}") from None
        prompt_ids = self.tokenizer.encode(text)
        params = req.to_sampling_params(default_max_tokens=self._room_left(len(prompt_ids)))
        formatter = ChatFormatter(f"chatcmpl-{uuid.uuid4().hex}", self.model_name, self._token_text_for(req),
                                  params.logprobs, req.include_usage)
        return await self._generate(raw, prompt_ids, params, formatter, bool(req.stream))

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
                        formatter: CompletionFormatter | ChatFormatter, stream: bool) -> Response:
        if self.role in ("prefill", "decode"):
            await self._bootstrap(raw, formatter.id)
            stream = stream and self.role == "decode"  # P answers once the KV is handed off
        request_stream = await self.async_engine.submit(formatter.id, prompt_ids, params)
        if stream:
            # The background task runs after the response ends however it ends, including a
            # disconnect before the first chunk (when the generator's finally never runs).
            return StreamingResponse(self._sse(request_stream, formatter), media_type="text/event-stream",
                                     background=BackgroundTask(self.async_engine.abort, formatter.id))
        outputs = await self._collect(raw, request_stream)
        if outputs is None:
            return Response(status_code=CLIENT_CLOSED_REQUEST)
        if outputs[-1].error:
            return JSONResponse(error_body(outputs[-1].error, None, 500, "server_error"), status_code=500)
        return JSONResponse(formatter.response(outputs))

    async def _bootstrap(self, raw: Request, request_id: str) -> None:
        """PD roles: read the router's bootstrap fields; D also finds P and checks its config (400 on mismatch)."""
        from specpd.disagg.worker import BootstrapInfo
        info = BootstrapInfo.from_body(await raw.json())
        if self.role == "decode":
            await asyncio.to_thread(self.engine.bootstrap, request_id, info)
        else:
            self.engine.expect(request_id, info)

    async def _sse(self, stream: RequestStream, formatter):
        last: RequestOutput | None = None
        try:
            async for out in stream:
                last = out
                for chunk in formatter.chunks(out):
                    yield sse(chunk)
            if last is not None and last.error:
                yield sse(error_body(last.error, None, 500, "server_error"))
            elif formatter.include_usage and last is not None:
                yield sse(formatter.usage_chunk(last))
        except EngineDeadError as exc:
            yield sse(error_body(str(exc), None, 503, "server_error"))
        finally:
            if not stream.finished:  # the client went away (this generator was cancelled)
                self.async_engine.abort(stream.request_id)
        yield SSE_DONE

    async def _collect(self, raw: Request, stream: RequestStream) -> list[RequestOutput] | None:
        """Every output of a non-streaming request; None if the client hung up first (then aborted)."""
        outputs: list[RequestOutput] = []

        async def consume():
            async for out in stream:
                outputs.append(out)

        consumer = asyncio.ensure_future(consume())
        watcher = asyncio.ensure_future(_client_disconnected(raw))
        try:
            done, _ = await asyncio.wait({consumer, watcher}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            watcher.cancel()
            if not consumer.done():  # the client hung up (or this handler was cancelled)
                consumer.cancel()
                self.async_engine.abort(stream.request_id)
        if consumer not in done:
            return None
        consumer.result()  # re-raises EngineDeadError
        return outputs

    # -- info ------------------------------------------------------------------------------
    async def models(self):
        return {"object": "list", "data": [{
            "id": self.model_name, "object": "model", "created": self.started, "owned_by": "specpd",
            "root": getattr(self.engine.config, "model", self.model_name), "max_model_len": self.engine.max_model_len}]}

    async def health(self):
        if not self.async_engine.alive:
            return JSONResponse(error_body(f"engine thread is not running: {self.async_engine.error!r}",
                                           None, 503, "server_error"), status_code=503)
        return {"status": "ok"}

    async def metrics(self):
        content, content_type = self.metrics_registry.render()
        return Response(content, media_type=content_type)

    async def server_info(self):
        stats = self.async_engine.stats()
        return {**stats, "role": self.role, "model": self.model_name, "max_model_len": self.engine.max_model_len,
                "config": self.engine.config.to_dict(), "pid": os.getpid(),
                "free_pages": stats.get("free_pages"), "total_pages": stats.get("total_pages"),
                "engine_alive": self.async_engine.alive}


def _token_id_text(token_id: int) -> str:
    return f"token_id:{token_id}"


async def _parse(raw: Request, model: type[BaseModel]):
    body = await raw.body()
    try:
        return model.model_validate_json(body)
    except ValidationError as err:
        raise field_errors(err) from None


async def _client_disconnected(raw: Request) -> None:
    """Returns when the client closes the connection (the body has been read, so receive() waits)."""
    while True:
        message = await raw.receive()
        if message["type"] == "http.disconnect":
            return
