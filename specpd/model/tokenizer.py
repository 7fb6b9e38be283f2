"""Tokenizer: a thin wrapper over `tokenizers.Tokenizer` plus the chat template.

Two sources:
  1. an HF directory: tokenizer.json + tokenizer_config.json (+ chat_template.jinja);
  2. a GGUF file's `tokenizer.*` metadata: byte-level BPE rebuilt from the
     vocabulary and merges, split the way `tokenizer.ggml.pre` says llama.cpp
     splits it (SmolLM2's "smollm" = every digit alone, then the GPT-2 regex).

BOS is added by us, and only when the model asks for it (`add_bos_token`):
SmolLM2's GGUF says False, its chat template writes <|im_start|> itself.
"""
from __future__ import annotations

import json
import logging
import os
from datetime import datetime
from typing import Any, Mapping, Sequence

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers
from tokenizers import Tokenizer as _BackendTokenizer

logger = logging.getLogger(__name__)

# GGUF tokenizer.ggml.token_type values (llama.cpp's llama_token_type).
_TOKEN_TYPE_CONTROL = 3
_TOKEN_TYPE_USER_DEFINED = 4

# End-of-turn markers of the common chat formats. One that is a special token
# and appears in the chat template also stops generation.
_END_OF_TURN_MARKERS = ("<|im_end|>", "<|eot_id|>", "<|eom_id|>", "<|end|>",
                        "<end_of_turn>", "<|end_of_turn|>")

_GPT2_SPLIT = (r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+"
               r"|\s+(?!\S)|\s+")
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")

# tokenizer.ggml.pre -> (split digits one by one first, split regex).
# Mirrors llama.cpp's llama-vocab.cpp regex_exprs for these pre-tokenizer types.
_GGUF_PRE_TOKENIZERS = {
    **{pre: (True, _GPT2_SPLIT) for pre in (
        "smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva")},
    **{pre: (False, _GPT2_SPLIT) for pre in ("gpt2", "mpt", "olmo", "jais", "default")},
    **{pre: (False, _LLAMA3_SPLIT) for pre in (
        "llama3", "llama-v3", "llama-bpe", "falcon3", "pixtral", "dbrx", "smaug-bpe")},
    **{pre: (False, _QWEN2_SPLIT) for pre in ("qwen2", "deepseek-r1-qwen", "megrez")},
}


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table used by byte-level BPE vocabularies."""
    printable = (list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
                 + list(range(ord("®"), ord("ÿ") + 1)))
    chars = printable[:]
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return dict(zip(printable, map(chr, chars)))


def _token_content(token: Any) -> str | None:
    if isinstance(token, Mapping):
        return token.get("content")
    return token


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: Any = None, sort_keys: bool = False) -> str:
    return json.dumps(value, indent=indent, ensure_ascii=ensure_ascii,
                      sort_keys=sort_keys, separators=separators)


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _compile_template(source: str) -> jinja2.Template:
    # Same environment as transformers' apply_chat_template.
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env.from_string(source)


class Tokenizer:
    """Text <-> token ids for one model, plus its chat template."""

    def __init__(self, backend: _BackendTokenizer, *, bos_token_id: int | None,
                 eos_token_id: int | None, add_bos_token: bool,
                 chat_template: str | None = None,
                 extra_eos_token_ids: Sequence[int] = (),
                 special_tokens: Mapping[str, str | None] | None = None):
        self._backend = backend
        self._bos_token_id = bos_token_id
        self._eos_token_id = eos_token_id
        self.add_bos_token = add_bos_token
        self._chat_template = chat_template
        self._compiled_template: jinja2.Template | None = None
        self._special_tokens = dict(special_tokens or {})
        for name, token_id in (("bos_token", bos_token_id), ("eos_token", eos_token_id)):
            if self._special_tokens.get(name) is None and token_id is not None:
                self._special_tokens[name] = backend.id_to_token(token_id)

        special_ids = {i for i, tok in backend.get_added_tokens_decoder().items() if tok.special}
        special_ids |= {i for i in (bos_token_id, eos_token_id) if i is not None}
        self._all_special_ids = tuple(sorted(special_ids))
        eos_ids = [eos_token_id] if eos_token_id is not None else []
        eos_ids += list(extra_eos_token_ids)
        for marker in _END_OF_TURN_MARKERS:
            marker_id = backend.token_to_id(marker)
            if marker_id in special_ids and chat_template and marker in chat_template:
                eos_ids.append(marker_id)
        self._eos_token_ids = tuple(dict.fromkeys(i for i in eos_ids if i is not None))

    # ---- constructors ---------------------------------------------------

    @classmethod
    def from_hf_dir(cls, path: str) -> "Tokenizer":
        tokenizer_file = os.path.join(path, "tokenizer.json")
        if not os.path.isfile(tokenizer_file):
            raise FileNotFoundError(f"no tokenizer.json in model directory {path!r}")
        backend = _BackendTokenizer.from_file(tokenizer_file)
        config: dict[str, Any] = {}
        config_file = os.path.join(path, "tokenizer_config.json")
        if os.path.isfile(config_file):
            with open(config_file, encoding="utf-8") as f:
                config = json.load(f)

        # added_tokens_decoder carries the special flags transformers saves.
        decoder = config.get("added_tokens_decoder") or {}
        known = backend.get_added_tokens_decoder()
        extra = [AddedToken(tok["content"], special=True, normalized=False,
                            lstrip=tok.get("lstrip", False), rstrip=tok.get("rstrip", False),
                            single_word=tok.get("single_word", False))
                 for index, tok in decoder.items()
                 if tok.get("special") and not (int(index) in known and known[int(index)].special)]
        if extra:
            backend.add_special_tokens(extra)

        special_tokens = {name: _token_content(config.get(name))
                          for name in ("bos_token", "eos_token", "unk_token", "pad_token")}

        def token_id(name: str) -> int | None:
            content = special_tokens.get(name)
            return backend.token_to_id(content) if content is not None else None

        extra_eos: list[int] = []
        for file_name in ("generation_config.json", "config.json"):
            file_path = os.path.join(path, file_name)
            if os.path.isfile(file_path):
                with open(file_path, encoding="utf-8") as f:
                    eos = json.load(f).get("eos_token_id")
                extra_eos += eos if isinstance(eos, list) else [eos] if eos is not None else []

        chat_template = config.get("chat_template")
        if isinstance(chat_template, list):  # [{"name": ..., "template": ...}, ...]
            named = {t["name"]: t["template"] for t in chat_template}
            chat_template = named.get("default", next(iter(named.values()), None))
        jinja_file = os.path.join(path, "chat_template.jinja")
        if chat_template is None and os.path.isfile(jinja_file):
            with open(jinja_file, encoding="utf-8") as f:
                chat_template = f.read()

        return cls(backend, bos_token_id=token_id("bos_token"), eos_token_id=token_id("eos_token"),
                   add_bos_token=bool(config.get("add_bos_token", False)),
                   chat_template=chat_template, extra_eos_token_ids=extra_eos,
                   special_tokens=special_tokens)

    @classmethod
    def from_gguf(cls, fields: Mapping[str, Any]) -> "Tokenizer":
        """Build from `GGUFReader.fields` (a name -> ReaderField mapping)."""

        def value(key: str, default: Any = None) -> Any:
            return fields[key].contents() if key in fields else default

        model_type = value("tokenizer.ggml.model")
        if model_type != "gpt2":
            raise NotImplementedError(
                f"GGUF tokenizer.ggml.model={model_type!r} is not supported (only 'gpt2', "
                "byte-level BPE)")
        tokens: list[str] = value("tokenizer.ggml.tokens")
        token_types: list[int] = value("tokenizer.ggml.token_type", [])
        merges = [tuple(m.split(" ", 1)) for m in value("tokenizer.ggml.merges", [])]

        alphabet = set(_bytes_to_unicode().values())
        spelling = _bytes_to_unicode()
        # Every ordinary token is spelled in the byte alphabet; control tokens
        # such as <|im_start|> are too, and are matched whole as added tokens.
        vocab = {(tok if set(tok) <= alphabet
                  else "".join(spelling[b] for b in tok.encode("utf-8"))): i
                 for i, tok in enumerate(tokens)}
        backend = _BackendTokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False,
                                               ignore_merges=False))
        pre = value("tokenizer.ggml.pre", "default")
        if pre not in _GGUF_PRE_TOKENIZERS:
            logger.warning("unknown GGUF tokenizer.ggml.pre %r: using the GPT-2 split", pre)
        split_digits, split_regex = _GGUF_PRE_TOKENIZERS.get(pre, (False, _GPT2_SPLIT))
        steps = [pre_tokenizers.Digits(individual_digits=True)] if split_digits else []
        steps += [pre_tokenizers.Split(Regex(split_regex), behavior="isolated"),
                  pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
        backend.pre_tokenizer = pre_tokenizers.Sequence(steps)
        backend.decoder = decoders.ByteLevel()

        control = [AddedToken(tok, special=True, normalized=False)
                   for tok, kind in zip(tokens, token_types)
                   if kind == _TOKEN_TYPE_CONTROL and set(tok) <= alphabet]
        user_defined = [AddedToken(tok, special=False, normalized=False)
                        for tok, kind in zip(tokens, token_types)
                        if kind == _TOKEN_TYPE_USER_DEFINED and tok in vocab]
        backend.add_special_tokens(control)
        backend.add_tokens(user_defined)

        extra_eos = [value(f"tokenizer.ggml.{key}_token_id") for key in ("eot", "eom")]
        return cls(backend,
                   bos_token_id=value("tokenizer.ggml.bos_token_id"),
                   eos_token_id=value("tokenizer.ggml.eos_token_id"),
                   add_bos_token=bool(value("tokenizer.ggml.add_bos_token", False)),
                   chat_template=value("tokenizer.chat_template"),
                   extra_eos_token_ids=[i for i in extra_eos if i is not None])

    def to_state(self) -> dict[str, Any]:
        """Everything this tokenizer was built from, as JSON: `from_state` rebuilds it exactly (the
        converted-checkpoint cache, specpd.model.gguf_cache, keeps a GGUF's tokenizer this way)."""
        return {"backend": self._backend.to_str(), "bos_token_id": self._bos_token_id,
                "eos_token_id": self._eos_token_id, "add_bos_token": self.add_bos_token,
                "chat_template": self._chat_template, "eos_token_ids": list(self._eos_token_ids),
                "special_tokens": self._special_tokens}

    @classmethod
    def from_state(cls, state: Mapping[str, Any]) -> "Tokenizer":
        return cls(_BackendTokenizer.from_str(state["backend"]), bos_token_id=state["bos_token_id"],
                   eos_token_id=state["eos_token_id"], add_bos_token=state["add_bos_token"],
                   chat_template=state["chat_template"], extra_eos_token_ids=state["eos_token_ids"],
                   special_tokens=state["special_tokens"])

    # ---- encode / decode ------------------------------------------------

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids = self._backend.encode(text, add_special_tokens=add_special_tokens).ids
        if (add_special_tokens and self.add_bos_token and self._bos_token_id is not None
                and (not ids or ids[0] != self._bos_token_id)):
            ids = [self._bos_token_id] + ids
        return ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self._backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_to_id(self, token: str) -> int | None:
        return self._backend.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        return self._backend.id_to_token(token_id)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            **kwargs: Any) -> str:
        if self._chat_template is None:
            raise ValueError("this tokenizer has no chat template")
        if self._compiled_template is None:
            self._compiled_template = _compile_template(self._chat_template)
        variables = {**self._special_tokens, **kwargs}
        return self._compiled_template.render(
            messages=messages, add_generation_prompt=add_generation_prompt, **variables)

    # ---- properties -----------------------------------------------------

    @property
    def bos_token_id(self) -> int | None:
        return self._bos_token_id

    @property
    def eos_token_id(self) -> int | None:
        return self._eos_token_id

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        """Every id that ends generation: eos, plus end-of-turn tokens."""
        return self._eos_token_ids

    @property
    def vocab_size(self) -> int:
        return self._backend.get_vocab_size(with_added_tokens=True)

    @property
    def all_special_ids(self) -> tuple[int, ...]:
        return self._all_special_ids

    @property
    def chat_template(self) -> str | None:
        return self._chat_template

    @property
    def backend(self) -> _BackendTokenizer:
        return self._backend
