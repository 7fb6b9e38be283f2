"""The decoder a runner holds: the model, its KV pool and its attention backend, built from HF-named weights.

One builder for TP 1 (runner.ModelRunner) and for every tensor-parallel rank (rank 0 in the runner, ranks 1..N-1
in tp._worker_main), so both import it from here rather than from each other.
"""
from __future__ import annotations

import torch

from specpd.attention.base import get_backend_class
from specpd.config import EngineConfig, ModelConfig
from specpd.kernels.cpu_linear import weights_on_huge_pages
from specpd.kv.pool import KVPool
from specpd.model.llama import CausalLM, Rotary
from specpd.model.moe_lm import build_moe_decoder
from specpd.model.quant import quantize_model, serve_blocks


def build_decoder(config: EngineConfig, model_config: ModelConfig, weights: dict[str, torch.Tensor],
                  max_model_len: int, device: torch.device, dtype: torch.dtype, pack: bool = True,
                  kv_extra_layers: int = 0, row_scales=None, blocks=None) -> tuple[CausalLM, KVPool, object]:
    """(decoder, its KV pool, its attention backend) from HF-named weights: the whole model, or one
    tensor-parallel rank's shard (`model_config` and `weights` of its heads, specpd/model/tp.py; `row_scales`:
    int8's whole-row scales of its row-parallel layers, tp.row_parallel_scales). `config.quantization` is
    resolved (specpd.model.quant.resolve); `blocks`: the GGUF's quantized matrices it serves for 'gguf'."""
    if model_config.moe is not None:  # DeepSeek-V3 / GLM-4.5: their own layers and pool (specpd/model/moe_lm.py)
        return build_moe_decoder(config, model_config, weights, max_model_len, device, dtype, pack, kv_extra_layers)
    with torch.device("meta"):
        model = CausalLM(model_config, max_model_len)
    model = model.to_empty(device=device)
    taken: set[str] = set()
    if config.quantization == "gguf":  # the file's blocks in place first: their dense copies are never loaded
        model.weight_formats, taken = serve_blocks(model, blocks or {}, weights)
    model.load_weights({k: v for k, v in weights.items() if k not in taken} if taken else weights)
    if config.quantization in ("int8", "int4"):  # from the checkpoint's precision, before the cast
        model.weight_formats = quantize_model(model, config.quantization, row_scales)
    model = model.to(dtype=dtype).eval()
    if device.type == "cpu" and pack:
        model.pack_for_cpu()  # weights prepacked once for oneDNN (specpd/kernels/cpu_linear.py)
    # RoPE tables are not in the checkpoint; build them after the dtype cast so they stay fp32
    model.rotary = Rotary(model_config, max_model_len).to(device)
    if device.type == "cpu":
        weights_on_huge_pages(model)
    cache = config.cache
    pool = KVPool.for_model(model_config, cache.page_size, dtype, device, memory_mb=cache.kv_cache_memory_mb,
                            num_pages=cache.num_pages, extra_layers=kv_extra_layers)
    backend = get_backend_class(config.attention_backend)(pool, model_config.num_heads, model_config.head_dim)
    return model, pool, backend
