"""Admission at the door, shared by the API server and the router (no torch here).

What a request meets before any handler runs (one ASGI middleware, `Admission`):
  1. API key: with `api_key` set, every route needs `Authorization: Bearer KEY`, else HTTP 401 with an
     OpenAI-style error body (as vLLM and SGLang answer): `/v1/*` and every admin route that changes state
     (`/flush_cache`, and any added later: the rule lists what stays open, not what is guarded). Only
     /health, /metrics and /server_info (read-only) stay open. Every role takes the key: a unified server,
     the router, and the prefill and decode servers behind it (the router sends it on).
  2. Body size: a `Content-Length` over `max_request_bytes` is answered 413 before a byte of the body is
     read; a body without one (chunked) is counted as it streams in and cut off with 413 the moment it
     passes the limit. Either way the handler never sees it, so nothing is parsed or tokenized.
  3. The handler receives the whole (bounded) body, already buffered here.
Later checks live with the handler: prompt text that could never fit the context (`max_prompt_chars`,
400) and queue depth (503 + Retry-After, AsyncEngine).

Where the key comes from (`api_key_of`, every role): `--api-key-file PATH` (refused when group or others may
read it), else $SPECPD_API_KEY (as vLLM reads VLLM_API_KEY), else `--api-key KEY`, which works but shows the key
in `ps` (a warning says so). `specpd serve --disagg` hands its children the key in their environment, never on a
command line.
"""
from __future__ import annotations

import hmac
import ipaddress
import json
import logging
import os
import stat
from typing import Any, Callable

logger = logging.getLogger(__name__)


def error_body(message: str, param: str | None, code: int,
               err_type: str = "invalid_request_error") -> dict[str, Any]:
    """OpenAI's error object, as every refusal of the server, the router and this middleware carries it."""
    return {"error": {"message": message, "type": err_type, "param": param, "code": code}}


DEFAULT_MAX_REQUEST_BYTES = 8 * 1024 * 1024
API_KEY_ENV = "SPECPD_API_KEY"
# A refused request's body is still read (and dropped) up to this much before the response ends and the
# connection closes: closing a socket with unread data sends a reset, and a client still uploading (httpx
# reads nothing until its body is sent) then gets a connection error instead of the 413 / 401.
_DRAIN_LIMIT_BYTES = 64 * 1024 * 1024
_OPEN_PATHS = ("/health", "/metrics", "/server_info", "/get_server_info")


def max_prompt_chars(tokenizer, max_model_len: int) -> int | None:
    """Prompt text longer than this can never fit the context, whatever it says: no token spells more
    characters than the longest vocabulary entry (byte-level BPE writes each byte as one character, so an
    entry's length bounds its decoded length; SmolLM2's longest is 81, a run of '#'). A fixed guess such as
    32 chars per token would refuse real prompts. Without a vocabulary: 256 per token. None: no tokenizer."""
    if tokenizer is None:
        return None
    longest = 256
    backend = getattr(tokenizer, "backend", None)
    try:
        vocab = backend.get_vocab(with_added_tokens=True) if backend is not None else tokenizer.get_vocab()
        longest = max(len(spelling) for spelling in vocab)
    except Exception:  # noqa: BLE001 - a tokenizer without a readable vocabulary keeps the generous bound
        pass
    return max_model_len * max(longest, 1)


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def warn_if_open(host: str, api_key: str | None, what: str) -> None:
    if api_key is None and not is_loopback(host):
        logger.warning("%s binds %s with no API key: anyone who reaches this port can generate (give it one in "
                       "%s or --api-key-file)", what, host, API_KEY_ENV)


class KeyFileError(SystemExit):
    """--api-key-file names a file that cannot hold the key safely (or at all): the command stops with this message,
    which names the path."""


def read_key_file(path: str) -> str:
    """The key in `path` (surrounding whitespace dropped); refused when group or others may access the file."""
    try:
        mode = os.stat(path).st_mode
        if mode & (stat.S_IRWXG | stat.S_IRWXO):
            raise KeyFileError(f"specpd serve: --api-key-file {path}: group or others may access it (mode "
                               f"{stat.filemode(mode)}): chmod 600 {path}")
        with open(path, encoding="utf-8") as f:
            key = f.read().strip()
    except OSError as e:
        raise KeyFileError(f"specpd serve: --api-key-file {path}: cannot read it: {e.strerror or e}") from None
    if not key:
        raise KeyFileError(f"specpd serve: --api-key-file {path}: the file is empty")
    return key


def api_key_of(api_key: str | None, api_key_file: str | None, argv: list[str]) -> str | None:
    """The key this server requires (module docstring): `api_key` is --api-key's value ($SPECPD_API_KEY when the
    flag is not given), `argv` the command line, to tell a key typed there (and visible in `ps`)."""
    typed = any(a == "--api-key" or a.startswith("--api-key=") for a in argv)
    if api_key_file:
        if typed:
            raise KeyFileError("specpd serve: give --api-key-file or --api-key, not both")
        return read_key_file(api_key_file)
    if typed:
        logger.warning("--api-key on the command line is visible to every user of this machine (ps); pass it "
                       "in %s or --api-key-file instead", API_KEY_ENV)
    return api_key or os.environ.get(API_KEY_ENV) or None


class _TooLarge(Exception):
    pass


class Admission:
    """ASGI middleware: API key, then the body-size limit, then the app with the buffered body."""

    def __init__(self, app, max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES, api_key: str | None = None,
                 on_refused: Callable[[str], None] | None = None):
        """on_refused(reason): called with "api_key" (401) or "body" (413), e.g. to count it."""
        if max_request_bytes < 1:
            raise ValueError(f"max_request_bytes must be >= 1, got {max_request_bytes}")
        self.app = app
        self.max_request_bytes = max_request_bytes
        self.api_key = api_key or None
        self.on_refused = on_refused or (lambda reason: None)

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        if self.api_key is not None and scope["path"] not in _OPEN_PATHS and not self._authorized(scope):
            self.on_refused("api_key")
            return await _reply(send, receive, 401, error_body("invalid or missing API key: send 'Authorization: "
                                                               "Bearer <key>'", None, 401, "authentication_error"),
                                {"www-authenticate": "Bearer"}, drain_bytes=_DRAIN_LIMIT_BYTES)
        if scope["method"] in ("GET", "HEAD", "OPTIONS", "DELETE"):
            return await self.app(scope, receive, send)
        declared = _content_length(scope)
        if declared is not None and declared > self.max_request_bytes:
            return await self._refuse(send, receive, declared)
        try:
            body, tail = await self._read_body(receive)
        except _TooLarge:
            return await self._refuse(send, receive, None)
        if tail is not None:  # the client left mid-upload
            return
        return await self.app(scope, _replay(body, receive), send)

    def _authorized(self, scope) -> bool:
        for name, value in scope["headers"]:
            if name == b"authorization":
                scheme, _, token = value.decode("latin-1").partition(" ")
                return scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(),
                                                                          self.api_key.encode())
        return False

    async def _read_body(self, receive) -> tuple[bytes, dict | None]:
        """(the whole body, None), or (partial, the disconnect message). Raises _TooLarge past the limit."""
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return b"", message
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_request_bytes:
                raise _TooLarge
            chunks.append(chunk)
            if not message.get("more_body", False):
                return b"".join(chunks), None

    async def _refuse(self, send, receive, declared: int | None) -> None:
        self.on_refused("body")
        size = f"{declared} bytes" if declared is not None else "a chunked body past the limit"
        await _reply(send, receive, 413, error_body(f"request body too large ({size}): this server accepts at "
                                                    f"most {self.max_request_bytes} bytes (--max-request-bytes)",
                                                    "body", 413), drain_bytes=_DRAIN_LIMIT_BYTES)


def _content_length(scope) -> int | None:
    for name, value in scope["headers"]:
        if name == b"content-length":
            try:
                return int(value)
            except ValueError:
                return None
    return None


async def _reply(send, receive, status: int, body: dict, headers: dict[str, str] | None = None,
                 drain_bytes: int = 0) -> None:
    """Send a refusal before the request body is (all) read: the whole answer goes out at once, for clients
    that read while they upload, but the response ends only after up to `drain_bytes` more of the body has
    been read and dropped (the server stops reading the request once its response is complete)."""
    payload = json.dumps(body).encode()
    raw_headers = [(b"content-type", b"application/json"), (b"content-length", str(len(payload)).encode()),
                   (b"connection", b"close")]
    raw_headers += [(k.encode(), v.encode()) for k, v in (headers or {}).items()]
    await send({"type": "http.response.start", "status": status, "headers": raw_headers})
    await send({"type": "http.response.body", "body": payload, "more_body": True})
    read = 0
    while read <= drain_bytes:
        message = await receive()
        if message["type"] != "http.request" or not message.get("more_body", False):
            break
        read += len(message.get("body", b""))
    await send({"type": "http.response.body", "body": b"", "more_body": False})


def _replay(body: bytes, receive):
    """A receive() that hands the app the buffered body once, then the real connection (disconnects)."""
    sent = False

    async def replay():
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replay
