"""The MoE families' causal LMs: DeepSeek-V3 (MLA + MoE, dense first layers, YaRN; R1, V3.1, Kimi-K2 share the
model_type) and GLM-4.5 / 4.6 (GQA with q/k/v bias, q/k norm and partial RoPE + the same MoE).

A MoECausalLM is a CausalLM (same forward, logits, head and draft bindings) whose layers are MoEDecoderLayers:
attention specpd/model/mla.py, the MLP a dense one below first_k_dense_replace and specpd/model/moe.py's above.
Its KV pool is a LatentKVPool with the MLA backend (DeepSeek: over the C kernel for `cpu` where the shape fits it,
else the torch backend; specpd/attention/mla.py) or a KVPool with the configured backend (GLM). Checkpoint layout: transformers'
names (the published one), per-expert tensors; the MTP layers after the last decoder layer
(model.layers.{num_hidden_layers + i}) are left to specpd/spec/draft/checkpoint_mtp.py. FP8 block-quantized weights
(DeepSeek's release) are dequantized at load (specpd/model/fp8.py).
Not here: tensor parallelism (specpd/model/tp.py refuses it), weight-only quantization, the C decoder stack.
"""
from __future__ import annotations

import re

import torch
from torch import nn

from specpd.attention.base import get_backend_class
from specpd.attention.mla import MLAAttentionBackend
from specpd.config import EngineConfig, ModelConfig
from specpd.kernels.cpu_linear import PackedLinear, mkldnn_ok, pack_linears, weights_on_huge_pages
from specpd.kv.latent_pool import LatentKVPool
from specpd.kv.pool import KVPool
from specpd.model.fp8 import dequantize_fp8
from specpd.model.llama import MLP, CausalLM, DecoderLayer, RMSNorm
from specpd.model.mla import GQAPartialRopeAttention, MLAAttention, split_kv_b
from specpd.model.moe import MoE, mlp_slots, moe_slots
from specpd.model.rope_scaling import make_rotary, mla_softmax_scale

_LAYER = re.compile(r"model\.layers\.(\d+)\..+")
Slots = dict[str, tuple[str, "tuple[int, int] | None"]]  # checkpoint key -> (parameter, row range or None)


class MoEDecoderLayer(DecoderLayer):
    """DecoderLayer's forward over the family's attention and MLP. `layer_id`: its KV layer in the pool;
    `hf_layer`: its index in the checkpoint (an MTP layer's is past the decoder's), which decides dense or MoE."""

    def __init__(self, cfg: ModelConfig, layer_id: int, hf_layer: int | None = None):
        nn.Module.__init__(self)
        hf_layer = layer_id if hf_layer is None else hf_layer
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = MLAAttention(cfg, layer_id) if cfg.mla is not None else GQAPartialRopeAttention(cfg, layer_id)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MoE(cfg) if cfg.moe.is_moe_layer(hf_layer) else MLP(cfg)


def make_block(cfg: ModelConfig, layer_id: int, hf_layer: int | None = None) -> DecoderLayer:
    """One decoder layer of the config's family (a draft's block: EAGLE's, MTP's)."""
    return DecoderLayer(cfg, layer_id) if cfg.moe is None else MoEDecoderLayer(cfg, layer_id, hf_layer)


def layer_slots(pub: str, mod: str, cfg: ModelConfig, hf_layer: int) -> Slots:
    """{checkpoint key: (parameter, rows)} of MoEDecoderLayer `hf_layer`: pub its checkpoint prefix
    ("model.layers.3."), mod its module path ("layers.3."); an MLA layer's kv_b_proj as split_kv_b's pieces."""
    a, m = f"{pub}self_attn.", f"{mod}self_attn."
    slots: Slots = {f"{pub}input_layernorm.weight": (f"{mod}input_layernorm.weight", None),
                    f"{pub}post_attention_layernorm.weight": (f"{mod}post_attention_layernorm.weight", None)}
    if cfg.mla is not None:
        names = ["kv_a_proj_with_mqa.weight", "kv_a_layernorm.weight", "o_proj.weight"]
        names += [f"w_{part}.{h}.weight" for part in ("uk", "uv") for h in range(cfg.num_heads)]  # split_kv_b's
        names += (["q_proj.weight"] if cfg.mla.q_lora_rank is None
                  else ["q_a_proj.weight", "q_a_layernorm.weight", "q_b_proj.weight"])
        if cfg.attention_bias:
            names += ["kv_a_proj_with_mqa.bias", "o_proj.bias"] + ([] if cfg.mla.q_lora_rank is None
                                                                  else ["q_a_proj.bias"])
        slots.update({a + n: (m + n, None) for n in names})
    else:
        q, kv = cfg.q_size, cfg.kv_size
        rows = {"q": (0, q), "k": (q, q + kv), "v": (q + kv, q + 2 * kv)}
        for part in ("weight", "bias") if cfg.attention_bias else ("weight",):
            slots.update({f"{a}{p}_proj.{part}": (f"{m}qkv_proj.{part}", r) for p, r in rows.items()})
        if cfg.qk_norm:
            slots.update({f"{a}{p}_norm.weight": (f"{m}{p}_norm.weight", None) for p in ("q", "k")})
        slots[f"{a}o_proj.weight"] = (f"{m}o_proj.weight", None)
    if cfg.moe.is_moe_layer(hf_layer):
        slots.update(moe_slots(pub, mod, cfg))
    else:
        slots.update(mlp_slots(f"{pub}mlp.", f"{mod}mlp.", cfg.intermediate_size))
    return slots


@torch.no_grad()
def load_slots(module: nn.Module, slots: Slots, weights: dict[str, torch.Tensor], source: str) -> None:
    """Copy every slot's tensor into `module` (strict: each slot present, the shapes equal, every parameter and
    buffer covered); ValueError naming the keys otherwise."""
    missing = sorted(k for k in slots if k not in weights)
    if missing:
        raise ValueError(f"{source} is missing weights: {missing[:5]}{' ...' if len(missing) > 5 else ''}")
    tensors = {**dict(module.named_parameters()), **dict(module.named_buffers())}
    filled = set()
    for key, (name, rows) in slots.items():
        dst = tensors[name] if rows is None else tensors[name][rows[0]:rows[1]]
        src = weights[key]
        if tuple(dst.shape) != tuple(src.shape):
            raise ValueError(f"{source}: {key} has shape {tuple(src.shape)}, expected {tuple(dst.shape)}")
        dst.copy_(src)
        filled.add(name)
    left = [n for n in tensors if n not in filled and not n.startswith("rotary.")]
    if left:
        raise ValueError(f"{source}: no checkpoint tensor fills {left[:5]}")


class MoECausalLM(CausalLM):
    def __init__(self, cfg: ModelConfig, max_positions: int):
        nn.Module.__init__(self)
        self.config = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(MoEDecoderLayer(cfg, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.rotary = make_rotary(cfg, max_positions)
        self.lm_head = None if cfg.tie_word_embeddings else nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.quantized_head = None
        self.packed_head: PackedLinear | None = None
        self.cpu_stack = None
        self.weight_formats: dict[str, int] = {}  # quantization is refused for these models

    @torch.no_grad()
    def pack_for_cpu(self) -> None:
        """Every linear (experts included) -> PackedLinear, and a packed copy of a tied head (CausalLM's, no stack)."""
        pack_linears(self)
        if self.lm_head is None and mkldnn_ok(self.embed_tokens.weight.dtype):
            self.packed_head = PackedLinear(self.embed_tokens.weight, None)

    @torch.no_grad()
    def load_weights(self, weights: dict[str, torch.Tensor]) -> None:
        """transformers' names; the checkpoint's MTP layers (index >= num_hidden_layers) are skipped here."""
        cfg = self.config
        slots: Slots = {"model.embed_tokens.weight": ("embed_tokens.weight", None),
                        "model.norm.weight": ("norm.weight", None)}
        if not cfg.tie_word_embeddings:
            slots["lm_head.weight"] = ("lm_head.weight", None)
        for i in range(cfg.num_layers):
            slots.update(layer_slots(f"model.layers.{i}.", f"layers.{i}.", cfg, i))
        weights = split_kv_b(dequantize_fp8(weights), cfg)
        unexpected = [k for k in weights if k not in slots and "rotary_emb" not in k
                      and not ((m := _LAYER.fullmatch(k)) and int(m.group(1)) >= cfg.num_layers)]
        if unexpected:
            raise ValueError(f"unexpected weights for {cfg.architecture}: {sorted(unexpected)[:5]}")
        load_slots(self, slots, weights, f"{cfg.architecture} checkpoint")


def make_kv(cfg: ModelConfig, page_size: int, dtype: torch.dtype, device, memory_mb: int = 512,
            num_pages: int | None = None, extra_layers: int = 0) -> KVPool:
    """The pool of a decoder of `cfg`: latent rows for MLA, K/V heads otherwise."""
    pool_cls = LatentKVPool if cfg.mla is not None else KVPool
    return pool_cls.for_model(cfg, page_size, dtype, device, memory_mb=memory_mb, num_pages=num_pages,
                              extra_layers=extra_layers)


def make_kv_like(cfg: ModelConfig, target_pool: KVPool) -> KVPool:
    """A pool for a draft of `cfg` on `target_pool`'s page ids (its allocator, page count, page size and dtype)."""
    if cfg.mla is not None:
        return LatentKVPool(target_pool.num_pages, cfg.num_layers, target_pool.page_size, cfg.mla.latent_dim,
                            target_pool.dtype, target_pool.buffer.device, allocator=target_pool.allocator)
    return KVPool(target_pool.num_pages, cfg.num_layers, target_pool.page_size, cfg.num_kv_heads, cfg.head_dim,
                  target_pool.dtype, target_pool.buffer.device, allocator=target_pool.allocator)


def make_backend(name: str, pool: KVPool, cfg: ModelConfig):
    """The attention backend over `pool` for layers of `cfg`: MLA's latent backend, else the named one."""
    if cfg.mla is not None:
        return MLAAttentionBackend(pool, cfg.num_heads, cfg.mla.kv_lora_rank, mla_softmax_scale(cfg), name)
    return get_backend_class(name)(pool, cfg.num_heads, cfg.head_dim)


def build_moe_decoder(config: EngineConfig, model_config: ModelConfig, weights: dict[str, torch.Tensor],
                      max_model_len: int, device: torch.device, dtype: torch.dtype, pack: bool = True,
                      kv_extra_layers: int = 0) -> tuple[MoECausalLM, KVPool, object]:
    """specpd/model/decoder.py's build_decoder for the MoE families: (decoder, its KV pool, its backend)."""
    if config.quantization != "none":
        raise ValueError(f"--quantization {config.quantization} is not supported for {model_config.architecture} "
                         f"(its weights load in the dtype given; FP8 checkpoints are dequantized at load)")
    with torch.device("meta"):
        model = MoECausalLM(model_config, max_model_len)
    model = model.to_empty(device=device)
    model.load_weights(weights)
    model = model.to(dtype=dtype).eval()
    if device.type == "cpu" and pack:
        model.pack_for_cpu()
    model.rotary = make_rotary(model_config, max_model_len).to(device)  # built after the cast: fp32 tables
    if device.type == "cpu":
        weights_on_huge_pages(model)
    cache = config.cache
    pool = make_kv(model_config, cache.page_size, dtype, device, cache.kv_cache_memory_mb, cache.num_pages,
                   kv_extra_layers)
    return model, pool, make_backend(config.attention_backend, pool, model_config)
