"""A converted copy of each GGUF checkpoint, so that only its first load pays for reading the GGUF.

Reading the default GGUF (SmolLM2-135M, Q4_1) costs ~12 s of CPU: gguf-py parses its ~100k tokenizer
strings one memmap view at a time, then every tensor is dequantized. Every server start (P, D, each
restart) and every test engine paid it. The first load writes what it produced under
`$SPECPD_CACHE/converted/<name>-<key>/`:
  config.json        the HF-style config load_gguf built
  model.safetensors  the dequantized weights, fp32 (exactly what load_gguf returns for fp32)
  blocks.safetensors the quantized matrices' raw blocks, uint8, their formats in its metadata (load_gguf's blocks)
  tokenizer.json     specpd's Tokenizer state (the `tokenizers` JSON plus the ids and template it derived)
and later loads read those (~1 s). The key hashes the GGUF's absolute path, size and mtime and
CONVERTED_FORMAT, so a replaced file or a change to the conversion gets a fresh copy. The copy is
written to a temporary directory and renamed into place, so concurrent first loads (two test workers,
P and D starting together) never see half a copy. A cache that cannot be written costs only the slow
load. SPECPD_CONVERTED_CACHE=0 turns it off.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import tempfile
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from specpd.kernels.cpu_gemm_q import BLOCK, BLOCK_BYTES
from specpd.machine import cache_root
from specpd.model.quant import QuantBlocks
from specpd.model.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

CONVERTED_FORMAT = 2  # bump when load_gguf's output for the same file changes (2: the blocks)


def converted_dir(path: str) -> str:
    st = os.stat(path)
    key = f"{os.path.abspath(path)}|{st.st_size}|{st.st_mtime_ns}|{CONVERTED_FORMAT}"
    stem = os.path.splitext(os.path.basename(path))[0]
    return os.path.join(cache_root(), "converted", f"{stem}-{hashlib.sha1(key.encode()).hexdigest()[:16]}")


def load_gguf_cached(path: str, dtype: torch.dtype = torch.float32
                     ) -> tuple[dict[str, Any], dict[str, torch.Tensor], Tokenizer | None, dict[str, QuantBlocks]]:
    """load_gguf(path, dtype), from the converted copy when there is one (made on the first load)."""
    from specpd.model.gguf_loader import load_gguf
    if os.environ.get("SPECPD_CONVERTED_CACHE", "1") == "0":
        return load_gguf(path, dtype)
    where = converted_dir(path)
    if os.path.isdir(where):
        try:
            return _read(where, dtype)
        except Exception as exc:  # noqa: BLE001 -- a damaged copy, whatever its damage: convert again
            logger.warning("converted copy of %s at %s is unreadable (%s): reading the GGUF", path, where, exc)
            shutil.rmtree(where, ignore_errors=True)
    config, weights, tokenizer, blocks = load_gguf(path, torch.float32)
    _write(where, config, weights, tokenizer, blocks)
    return config, {k: v.to(dtype) for k, v in weights.items()}, tokenizer, blocks


def _read(where: str, dtype: torch.dtype):
    with open(os.path.join(where, "config.json"), encoding="utf-8") as f:
        config = json.load(f)
    weights = {k: v.to(dtype) for k, v in load_file(os.path.join(where, "model.safetensors")).items()}
    tokenizer = None
    tok_file = os.path.join(where, "tokenizer.json")
    if os.path.isfile(tok_file):
        with open(tok_file, encoding="utf-8") as f:
            tokenizer = Tokenizer.from_state(json.load(f))
    blocks = {}
    with safe_open(os.path.join(where, "blocks.safetensors"), framework="pt") as f:
        formats = f.metadata() or {}
        for name in f.keys():
            raw = f.get_tensor(name)
            blocks[name] = QuantBlocks(formats[name], raw, raw.shape[1] // BLOCK_BYTES[formats[name]] * BLOCK)
    return config, weights, tokenizer, blocks


def _write(where: str, config, weights, tokenizer, blocks) -> None:
    parent = os.path.dirname(where)
    try:
        os.makedirs(parent, exist_ok=True)
        tmp = tempfile.mkdtemp(dir=parent, prefix=".converting-")
    except OSError as exc:
        logger.info("not caching the converted checkpoint (%s)", exc)
        return
    try:
        with open(os.path.join(tmp, "config.json"), "w", encoding="utf-8") as f:
            json.dump(config, f)
        save_file({k: v.contiguous() for k, v in weights.items()}, os.path.join(tmp, "model.safetensors"))
        save_file({k: b.blocks.contiguous() for k, b in blocks.items()}, os.path.join(tmp, "blocks.safetensors"),
                  metadata={k: b.fmt for k, b in blocks.items()})
        if tokenizer is not None:
            with open(os.path.join(tmp, "tokenizer.json"), "w", encoding="utf-8") as f:
                json.dump(tokenizer.to_state(), f)
        os.rename(tmp, where)  # fails if another process got there first: its copy is as good
    except OSError as exc:
        if not os.path.isdir(where):
            logger.info("not caching the converted checkpoint (%s)", exc)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
