"""The grammar backend (xgrammar): one engine's tokenizer, a compile cache, per-request matchers.

1. `GrammarBackend(tokenizer, vocab_size, eos_token_ids)` describes the vocabulary to xgrammar once: every
   token's byte-level spelling, special tokens (other than EOS) blanked so no grammar can emit them, and
   the matcher's stop set = the engine's EOS ids, so EOS is allowed exactly where the grammar can end.
2. `compile(kind, spec, field)` compiles a constraint, cached per (kind, spec) (failures too). It runs
   in whatever thread calls it and releases the GIL: the server calls it in a worker thread before the
   request reaches the engine, so a slow schema never blocks the event loop or the engine step.
3. `matcher(kind, spec)` gives a request its `RequestGrammar` (specpd.grammar.matcher), which the engine
   advances over committed tokens only.
"""
from __future__ import annotations

import json
import re
import threading
import time
from collections import OrderedDict
import xgrammar as xgr

from specpd.core import InvalidRequest
from specpd.grammar.constraint import KINDS
from specpd.grammar.matcher import GrammarStats, RequestGrammar

_ERROR_PREFIX = re.compile(r"^\[[\d:]+\] \S+?:\d+: ")  # "[10:33:24] /project/cpp/x.cc:94: " on xgrammar errors
_OBJECT_SCHEMA = '{"type": "object"}'  # json_object: OpenAI's JSON mode asks for an object


class GrammarBackend:
    def __init__(self, tokenizer, vocab_size: int, eos_token_ids: tuple[int, ...], cache_size: int = 256):
        """vocab_size: the model's logits width (may exceed the tokenizer's vocabulary: padding)."""
        if tokenizer is None:
            raise InvalidRequest("response_format", "structured outputs need the model's tokenizer; this "
                                                    "checkpoint has none")
        self.vocab_size = vocab_size
        self.eos_token_ids = tuple(eos_token_ids)
        self.info = _tokenizer_info(tokenizer, vocab_size, self.eos_token_ids)
        self._compiler = xgr.GrammarCompiler(self.info, max_threads=1, cache_enabled=False)
        self._cache: OrderedDict[tuple[str, str], object] = OrderedDict()  # -> CompiledGrammar | InvalidRequest
        self._cache_size = cache_size
        self._lock = threading.Lock()
        self.stats = GrammarStats()

    def compile(self, kind: str, spec: str, field: str | None = None):
        """The compiled grammar, or InvalidRequest naming `field` (default: the kind)."""
        field = field or kind
        key = (kind, spec)
        with self._lock:
            hit = self._cache.get(key)
            if hit is not None:
                self._cache.move_to_end(key)
                self.stats.compile_cache_hits += 1
        if hit is None:
            t0 = time.perf_counter()
            try:
                hit = self._compile(kind, spec)
            except (RuntimeError, ValueError) as e:  # xgrammar reports bad schemas / regexes as RuntimeError
                hit = InvalidRequest(field, _clean(str(e)))
            with self._lock:
                self.stats.compile_seconds += time.perf_counter() - t0
                self.stats.compiles += 1
                self._cache[key] = hit
                while len(self._cache) > self._cache_size:
                    self._cache.popitem(last=False)
        if isinstance(hit, InvalidRequest):
            raise InvalidRequest(field, hit.message)
        return hit

    def matcher(self, kind: str, spec: str) -> RequestGrammar:
        return RequestGrammar(xgr.GrammarMatcher(self.compile(kind, spec)), self.vocab_size, self.stats)

    def _compile(self, kind: str, spec: str):
        if kind not in KINDS:
            raise ValueError(f"unknown constraint kind {kind!r} (one of {', '.join(KINDS)})")
        if kind in ("json_schema", "json_object"):
            text = spec if kind == "json_schema" else _OBJECT_SCHEMA
            try:
                json.loads(text)
            except json.JSONDecodeError as e:
                raise ValueError(f"is not valid JSON: {e}") from None
            # compact separators: a small model offered free whitespace can loop on newlines forever
            return self._compiler.compile_json_schema(text, any_whitespace=False, strict_mode=True)
        if kind == "regex":
            return self._compiler.compile_regex(spec)
        if kind == "choice":
            choices = json.loads(spec)
            return self._compiler.compile_grammar(
                "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices))
        return self._compiler.compile_grammar(spec)


def _tokenizer_info(tokenizer, vocab_size: int, eos_token_ids: tuple[int, ...]) -> "xgr.TokenizerInfo":
    backend = tokenizer.backend  # tokenizers.Tokenizer
    meta = xgr.TokenizerInfo._detect_metadata_from_hf(backend.to_str())
    blank = set(tokenizer.all_special_ids) - set(eos_token_ids)
    n = min(vocab_size, tokenizer.vocab_size)
    # "" marks a token no grammar may produce (xgrammar treats empty tokens as special); ids past the
    # tokenizer's vocabulary (lm_head padding) are special too
    vocab = ["" if i in blank else (backend.id_to_token(i) or "") for i in range(n)]
    return xgr.TokenizerInfo(vocab, meta["vocab_type"], vocab_size=vocab_size, stop_token_ids=list(eos_token_ids),
                             add_prefix_space=meta["add_prefix_space"])


def _clean(message: str) -> str:
    return _ERROR_PREFIX.sub("", message.strip()).strip() or "the grammar backend refused it"
