"""Prefix-affinity routing for the PD router (no tokenizer, no torch).

Requests whose leading text is the same (a multi-turn conversation's first messages, a shared system prompt)
go to the same prefill and decode server, so their prefix caches hit. The key is a hash of the first
`KEY_CHARS` characters of the prompt text (chat: the messages' roles and contents in order); each server's
weight for a key is a rendezvous hash, so adding or losing a server moves only its own keys. A server is
"full" when it has at least `max(MIN_INFLIGHT, 2 x the mean)` requests in flight through this router; then the
least-loaded server takes the request instead.
"""
from __future__ import annotations

import hashlib
import json
from typing import Any

KEY_CHARS = 1024  # leading characters hashed: a system prompt or a conversation's first turn
MIN_INFLIGHT = 4  # below this a server is never "full"


def prefix_text(body: dict[str, Any]) -> str:
    """The leading text of a completion or chat body, as the server would see it before templating."""
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
            if sum(len(p) for p in parts) >= KEY_CHARS:
                break
        return "".join(parts)
    prompt = body.get("prompt")
    if isinstance(prompt, list):  # token ids, or a batch (its first prompt)
        prompt = prompt[0] if prompt and isinstance(prompt[0], (str, list)) else prompt
        if isinstance(prompt, list):
            prompt = " ".join(str(t) for t in prompt[:KEY_CHARS // 4])
    return prompt if isinstance(prompt, str) else ""


def prefix_key(body: dict[str, Any]) -> bytes:
    return hashlib.blake2b(prefix_text(body)[:KEY_CHARS].encode(), digest_size=8).digest()


class AffinityPicker:
    """One server pool (all P, or all D): pick by prefix affinity, fall back to load."""

    def __init__(self, urls: list[str]):
        self.urls = list(urls)
        self.inflight = {u: 0 for u in self.urls}

    def pick(self, key: bytes) -> str:
        if len(self.urls) == 1:
            return self.urls[0]
        best = max(self.urls, key=lambda u: hashlib.blake2b(key + u.encode(), digest_size=8).digest())
        mean = sum(self.inflight.values()) / len(self.urls)
        if self.inflight[best] >= max(MIN_INFLIGHT, 2 * mean):
            return min(self.urls, key=lambda u: (self.inflight[u], u))
        return best

    def acquire(self, url: str) -> None:
        self.inflight[url] += 1

    def release(self, url: str) -> None:
        self.inflight[url] = max(0, self.inflight[url] - 1)
