"""GGUF checkpoints -> HF-named fp tensors + an HF-style config dict (+ the blocks of quantized tensors).

1. Read metadata and tensors with `gguf.GGUFReader`.
2. Dequantize each tensor (`gguf.quants.dequantize`) into torch order:
   GGUF lists shapes fastest-dimension first, so `[576, 1536]` in the file is
   a `[1536, 576]` torch weight.
3. Keep the raw blocks of each Q4_0 / Q4_1 / Q8_0 matrix beside it (specpd.model.quant.QuantBlocks: a row of
   blocks per output row), which the quantized kernel serves as they are.
4. Rename llama.cpp tensor names to HF parameter names.
5. Undo llama.cpp's q/k row permutation for llama-arch files (see
   `unpermute_qk`) on the weights and on the blocks alike: it moves whole rows, so blocks stay intact.
   Qwen2/Qwen3 files are written unpermuted.
6. Build the HF config.json equivalent from `<arch>.*` metadata.
"""
from __future__ import annotations

import logging
import re
from typing import Any

import numpy as np
import torch
from gguf import GGUFReader
from gguf.quants import dequantize

from specpd.kernels.cpu_gemm_q import FORMATS
from specpd.model.quant import QuantBlocks
from specpd.model.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

_SUPPORTED_ARCHS = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM",
                    "qwen3": "Qwen3ForCausalLM"}
# Architectures whose convert script permutes attn_q / attn_k rows for
# llama.cpp's interleaved ("normal", not NeoX) rope.
_PERMUTED_QK_ARCHS = {"llama"}

_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_BLOCK_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
# Tensors llama.cpp keeps for its own kernels that HF recomputes (llama3 rope
# frequencies follow from rope_scaling).
_SKIPPED = {"rope_freqs.weight"}
_BLOCK_RE = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)$")


def gguf_to_hf_name(name: str) -> str:
    if name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[name]
    match = _BLOCK_RE.match(name)
    if match is None or match.group(2) not in _BLOCK_NAMES:
        raise KeyError(f"GGUF tensor {name!r} has no HF equivalent known to specpd")
    layer, part, kind = match.groups()
    return f"model.layers.{layer}.{_BLOCK_NAMES[part]}.{kind}"


def unpermute_qk(weight: torch.Tensor, n_head: int) -> torch.Tensor:
    """Inverse of llama.cpp convert_hf_to_gguf.py `LlamaModel.permute`.

    HF keeps each head's rotary halves apart (NeoX layout: dims [0, d/2) pair
    with [d/2, d)); llama.cpp wants pairs adjacent (2i, 2i+1). Its convert
    script does, per head of `head_dim = rows // n_head` rows,
        w.reshape(n_head, 2, head_dim // 2, *rest).swapaxes(1, 2)
    i.e. row h*d + 2i + j  <-  HF row h*d + j*d/2 + i. We undo it by reading
    the rows as (n_head, head_dim // 2, 2) and swapping back. Works for
    weights [rows, cols] and biases [rows]. `n_head` is the KV head count for k.
    """
    rows = weight.shape[0]
    head_dim = rows // n_head
    return (weight.reshape(n_head, head_dim // 2, 2, *weight.shape[1:])
            .transpose(1, 2).reshape(weight.shape))


def permute_qk(weight: torch.Tensor, n_head: int) -> torch.Tensor:
    """llama.cpp's forward permutation (HF -> GGUF); kept as the test oracle."""
    rows = weight.shape[0]
    head_dim = rows // n_head
    return (weight.reshape(n_head, 2, head_dim // 2, *weight.shape[1:])
            .transpose(1, 2).reshape(weight.shape))


def _field(fields: dict, key: str, default: Any = None) -> Any:
    return fields[key].contents() if key in fields else default


def build_hf_config(reader: GGUFReader) -> dict[str, Any]:
    fields = reader.fields
    arch = _field(fields, "general.architecture")
    if arch not in _SUPPORTED_ARCHS:
        raise NotImplementedError(
            f"GGUF architecture {arch!r} is not supported (supported: {sorted(_SUPPORTED_ARCHS)})")

    def meta(key: str, default: Any = None) -> Any:
        return _field(fields, f"{arch}.{key}", default)

    hidden_size = meta("embedding_length")
    num_heads = meta("attention.head_count")
    num_kv_heads = meta("attention.head_count_kv", num_heads)
    head_dim = meta("attention.key_length", hidden_size // num_heads)
    vocab_size = meta("vocab_size")
    if vocab_size is None:
        vocab_size = len(fields["tokenizer.ggml.tokens"].data)
    tensor_names = {t.name for t in reader.tensors}

    rope_scaling = None
    scaling_type = meta("rope.scaling.type")
    if scaling_type not in (None, "none"):
        rope_scaling = {"rope_type": scaling_type, "factor": meta("rope.scaling.factor")}
        original = meta("rope.scaling.original_context_length")
        if original is not None:
            rope_scaling["original_max_position_embeddings"] = original

    config = {
        "architectures": [_SUPPORTED_ARCHS[arch]],
        "model_type": arch,
        "vocab_size": int(vocab_size),
        "hidden_size": int(hidden_size),
        "intermediate_size": int(meta("feed_forward_length")),
        "num_hidden_layers": int(meta("block_count")),
        "num_attention_heads": int(num_heads),
        "num_key_value_heads": int(num_kv_heads),
        "head_dim": int(head_dim),
        "hidden_act": "silu",
        "rms_norm_eps": float(meta("attention.layer_norm_rms_epsilon", 1e-6)),
        "rope_theta": float(meta("rope.freq_base", 10000.0)),
        "rope_scaling": rope_scaling,
        "max_position_embeddings": int(meta("context_length", 2048)),
        "tie_word_embeddings": "output.weight" not in tensor_names,
        "attention_bias": "blk.0.attn_q.bias" in tensor_names,
        "mlp_bias": False,
        "bos_token_id": _field(fields, "tokenizer.ggml.bos_token_id"),
        "eos_token_id": _field(fields, "tokenizer.ggml.eos_token_id"),
        "pad_token_id": _field(fields, "tokenizer.ggml.padding_token_id"),
    }
    if arch == "qwen2":
        config["use_sliding_window"] = False
    return config


def _tensor_to_torch(tensor) -> torch.Tensor:
    array = dequantize(tensor.data, tensor.tensor_type)
    # Torch order is the GGUF shape reversed (ne0 is the contiguous dim).
    torch_shape = tuple(int(d) for d in reversed(tensor.shape.tolist()))
    # F32/F16 tensors come back as read-only views of the mmap: copy those.
    array = np.require(array, requirements=["C_CONTIGUOUS", "WRITEABLE"])
    return torch.from_numpy(array.reshape(torch_shape))


def _blocks(tensor, weight: torch.Tensor) -> QuantBlocks | None:
    """A quantized matrix's blocks as the file stores them, [rows, row bytes] uint8 (None for other tensors)."""
    fmt = tensor.tensor_type.name
    if fmt not in FORMATS or weight.dim() != 2:
        return None
    raw = np.ascontiguousarray(tensor.data).reshape(weight.shape[0], -1)  # a copy out of the read-only mmap
    return QuantBlocks(fmt, torch.from_numpy(raw.copy()), weight.shape[1])


def load_gguf(path: str, dtype: torch.dtype = torch.float32
              ) -> tuple[dict[str, Any], dict[str, torch.Tensor], Tokenizer | None, dict[str, QuantBlocks]]:
    """Return (hf_config, HF-named weights, tokenizer, HF-named blocks of the quantized matrices) for one GGUF."""
    reader = GGUFReader(path)
    config = build_hf_config(reader)
    permuted = config["model_type"] in _PERMUTED_QK_ARCHS
    weights: dict[str, torch.Tensor] = {}
    blocks: dict[str, QuantBlocks] = {}
    for tensor in reader.tensors:
        if tensor.name in _SKIPPED:
            logger.warning("%s: ignoring %s (llama3-style rope scaling is not read from GGUF)",
                           path, tensor.name)
            continue
        name = gguf_to_hf_name(tensor.name)
        weight = _tensor_to_torch(tensor)
        qb = _blocks(tensor, weight)
        heads = None
        if permuted and ".self_attn.q_proj." in name:
            heads = config["num_attention_heads"]
        elif permuted and ".self_attn.k_proj." in name:
            heads = config["num_key_value_heads"]
        if heads is not None:
            weight = unpermute_qk(weight, heads)
            if qb is not None:  # whole rows move: each row's blocks with it
                qb = QuantBlocks(qb.fmt, unpermute_qk(qb.blocks, heads).contiguous(), qb.in_features)
        weights[name] = weight.to(dtype)
        if qb is not None:
            blocks[name] = qb
    try:
        tokenizer = Tokenizer.from_gguf(reader.fields)
    except NotImplementedError as exc:
        logger.warning("%s: no tokenizer loaded: %s", path, exc)
        tokenizer = None
    return config, weights, tokenizer, blocks
