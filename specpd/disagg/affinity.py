"""Prefix-affinity routing for the PD router (no tokenizer, no torch).

Requests whose leading text is the same (a multi-turn conversation's first messages, a shared system prompt)
go to the same prefill and decode server, so their prefix caches hit. The key is a hash of the text every
turn of a conversation starts with (`prefix_text`); each server's
weight for a key is a rendezvous hash, so adding or losing a server moves only its own keys. The preferred server
is "full" when it has `IMBALANCE` more requests in flight through this router than the least-loaded one and
more than 1.5x its count (SGLang's cache-aware router balances the same way); then the least loaded takes it.
"""
from __future__ import annotations

import hashlib
import json
from typing import Any

KEY_CHARS = 1024  # at most this much of the leading messages is hashed
PROMPT_CHARS = 256  # completion prompts: the leading characters hashed
PROMPT_TOKENS = 64  # token-id prompts: the leading ids hashed
IMBALANCE = 4  # the preferred server is "full" with this many more requests in flight than the least loaded


def prefix_text(body: dict[str, Any]) -> str:
    """The text every turn of a conversation starts with: chat, the messages up to and including the first
    user message (the system prompt and the first question); a completion prompt, its first PROMPT_CHARS
    characters (a client that appends turns to one prompt keeps them)."""
    messages = body.get("messages")
    if isinstance(messages, list):
        parts = []
        for m in messages:
            if not isinstance(m, dict):
                continue
            content = m.get("content")
            if not isinstance(content, str):
                content = json.dumps(content, sort_keys=True)
            parts.append(f"<{m.get('role')}>{content}")
            if m.get("role") == "user":
                break
        return "".join(parts)[:KEY_CHARS]
    prompt = body.get("prompt")
    if isinstance(prompt, list):  # token ids, or a batch (its first prompt)
        prompt = prompt[0] if prompt and isinstance(prompt[0], (str, list)) else prompt
        if isinstance(prompt, list):
            return " ".join(str(t) for t in prompt[:PROMPT_TOKENS])
    return prompt[:PROMPT_CHARS] if isinstance(prompt, str) else ""


def prefix_key(body: dict[str, Any]) -> bytes:
    return hashlib.blake2b(prefix_text(body).encode(), digest_size=8).digest()


class AffinityPicker:
    """One server pool (all P, or all D): pick by prefix affinity, fall back to load."""

    def __init__(self, urls: list[str]):
        self.urls = list(urls)
        self.inflight = {u: 0 for u in self.urls}

    def pick(self, key: bytes, among: list[str] | None = None) -> str:
        """`among`: the servers that may take it (the router's up ones; default all)."""
        urls = among or self.urls
        if len(urls) == 1:
            return urls[0]
        best = max(urls, key=lambda u: hashlib.blake2b(key + u.encode(), digest_size=8).digest())
        least = min(urls, key=lambda u: (self.inflight[u], u))
        load, low = self.inflight[best], self.inflight[least]
        return least if load - low >= IMBALANCE and load > 1.5 * low else best

    def acquire(self, url: str) -> None:
        self.inflight[url] += 1

    def release(self, url: str) -> None:
        self.inflight[url] = max(0, self.inflight[url] - 1)
