"""Incremental detokenization with stop-string handling.

Text is decoded from a short window of preceding tokens (so leading spaces and multi-byte
characters come out right) and released only when it cannot still turn into a stop string:
the last `max_stop_len - 1` characters are held back until more text or the end arrives.
"""
from __future__ import annotations

_CONTEXT = 5  # prompt tokens decoded as left context for the first output tokens


class IncrementalDetokenizer:
    def __init__(self, tokenizer, prompt_ids: list[int], stop: tuple[str, ...], skip_special_tokens: bool):
        self.tokenizer = tokenizer
        self.skip_special = skip_special_tokens
        self.stop = stop
        self.hold = max((len(s) for s in stop), default=1) - 1
        self.ids: list[int] = list(prompt_ids[-_CONTEXT:])
        self.prefix_offset = 0
        self.read_offset = len(self.ids)
        self.text = ""  # all decoded output text (stop string cut away once found)
        self.emitted = 0  # characters of self.text already returned to the caller

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special)

    def add(self, token_ids: list[int], check_stop: bool = True) -> str | None:
        """Append tokens; returns the stop string if one now appears in the text (text is cut before it).
        Stop strings are not looked for while `check_stop` is False (min_tokens not reached)."""
        for tok in token_ids:
            self.ids.append(tok)
            prefix = self._decode(self.ids[self.prefix_offset:self.read_offset])
            full = self._decode(self.ids[self.prefix_offset:])
            if len(full) > len(prefix) and not full.endswith("\ufffd"):
                start = len(self.text)
                self.text += full[len(prefix):]
                self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
                hit = self._find_stop(start) if check_stop else None
                if hit is not None:
                    return hit
        return None

    def _find_stop(self, new_from: int) -> str | None:
        best = None
        for s in self.stop:
            idx = self.text.find(s, max(0, new_from - len(s) + 1))
            if idx != -1 and (best is None or idx < best[0]):
                best = (idx, s)
        if best is None:
            return None
        self.text = self.text[:best[0]]
        return best[1]

    def take(self, final: bool) -> str:
        """Text not yet returned that is safe to release."""
        limit = len(self.text) if final else max(self.emitted, len(self.text) - self.hold)
        out = self.text[self.emitted:limit]
        self.emitted = limit
        return out
