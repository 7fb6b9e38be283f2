"""Quantized weights on CPU: a GGUF's blocks served as the file holds them, or dense weights quantized into the
same blocks, all multiplied by one kernel (specpd/kernels/cpu_gemm_q.py: Q4_0, Q4_1, Q8_0; AVX2 and AVX512-VNNI;
fp32 or bf16 activations).

Decode at small batch streams every weight once per step, so it is bound by memory: the default GGUF's Q4_1
layers and Q8_0 head hold a fraction of the fp32 bytes (evals/kernels_gemm_q.py -> evals/results/kernels_gemm_q.json
times one forward's linears on each path against those bytes' floor).

`--quantization` (EngineConfig.quantization; `resolve` decides `auto`):
  - gguf: every linear (and the LM head) whose GGUF tensor is Q4_0 / Q4_1 / Q8_0 runs from those blocks. The
    loader keeps them beside the dequantized weights (specpd/model/gguf_loader.py), q/k rows un-permuted as whole
    rows; qkv_proj / gate_up_proj stack the q, k, v (gate, up) rows, so a fused linear is its parts' blocks
    stacked when they share a format. Anything else (F16 / F32 / K-quant tensors, parts of two formats, K not a
    multiple of 32) stays dense: the dtype's path, exact.
  - int8 / int4: the dense linears quantized with llama.cpp's reference quantizer into Q8_0 / Q4_1 blocks (any
    checkpoint, any dtype). The LM head is Q8_0 in both: re-quantizing it to 4 bits is the one lossy step that
    shows (greedy SmolLM2 drifted from dense several times sooner with an int4 head than with an int8 one, at
    about the same speed). Re-quantizing the default GGUF's dequantized weights gives back its blocks bit for bit
    (tests/model/test_quant.py), so int4 on it equals gguf.
  - none: dequantized dense weights.
  - auto (the default): gguf for a GGUF with such tensors on a CPU where the kernel runs, at tp_size 1, on a
    packed (serving) model; none otherwise. SPECPD_AUTO_QUANTIZATION=none pins it to none (the test suite does:
    its references are dense fp32 HF outputs).
The activations are quantized per 32-block to int8 inside the kernel (llama.cpp's scheme), so greedy output is
not bit-identical to the dequantized fp32 engine's: tests/model/test_quant_engine.py bounds the token agreement
and evals/engine_quant.py measures it. Speculation stays lossless: the kernel is batch invariant.
The embedding lookup keeps the dense table (the dtype's), so drafts that borrow it see the same values.
Tensor parallelism: int8 / int4 quantize each rank's shard, TP 1's blocks sliced (32-weight blocks never straddle
a shard whose width is a multiple of 32: tp.check_quantization); gguf is TP 1 only.
"""
from __future__ import annotations

import logging
import os
from dataclasses import dataclass

import torch
from torch import nn

from specpd.config import EngineConfig
from specpd.kernels import cpu_gemm_q
from specpd.kernels.cpu_linear import QuantLinear

logger = logging.getLogger(__name__)

QUANT_METHODS = ("auto", "none", "gguf", "int4", "int8")
DENSE_FORMATS = {"int8": "Q8_0", "int4": "Q4_1"}  # what int8 / int4 quantize the dense linears into
HEAD_FORMAT = "Q8_0"  # the LM head's format for int8 / int4 (module docstring)
INT4_GROUP = cpu_gemm_q.BLOCK  # weights per block along the input dim (tp.check_quantization)
INT4_ROWS = 1  # the kernel takes any number of output rows


@dataclass(frozen=True)
class QuantBlocks:
    """A weight in GGUF blocks: `blocks` [N, K / 32 * block bytes] uint8, row n the blocks of output row n."""

    fmt: str  # "Q4_0" | "Q4_1" | "Q8_0"
    blocks: torch.Tensor
    in_features: int

    @property
    def out_features(self) -> int:
        return self.blocks.shape[0]

    def dequantize(self) -> torch.Tensor:
        """The [N, K] fp32 weight (what the GGUF's dequantizer gives)."""
        return cpu_gemm_q.dequantize(self.fmt, self.blocks, self.in_features)


def check_config(config: EngineConfig) -> None:
    if config.quantization not in QUANT_METHODS:
        raise ValueError(f"quantization must be one of {QUANT_METHODS}, got {config.quantization!r}")
    if config.quantization in ("auto", "none"):
        return
    if torch.device(config.device).type != "cpu":
        raise ValueError(f"quantization={config.quantization!r} is implemented for device='cpu' only, "
                         f"got device={config.device!r}")
    if config.quantization == "gguf" and config.tp_size != 1:
        raise ValueError(f"quantization='gguf' serves the file's blocks at tp_size 1 only, got tp_size="
                         f"{config.tp_size} (int8 / int4 quantize each rank's shard)")


def resolve(config: EngineConfig, blocks: dict[str, QuantBlocks], pack: bool = True) -> str:
    """The method `config.quantization` means for this checkpoint (`blocks`: its GGUF blocks) and machine."""
    check_config(config)
    method = config.quantization
    if method == "gguf" and not blocks:
        raise ValueError(f"quantization='gguf' needs a GGUF checkpoint holding Q4_0 / Q4_1 / Q8_0 tensors; "
                         f"{config.model!r} has none")
    if method != "auto":
        return method
    if os.environ.get("SPECPD_AUTO_QUANTIZATION") == "none":
        return "none"
    usable = any(cpu_gemm_q.usable(b.fmt, b.in_features) for b in blocks.values())
    cpu = torch.device(config.device).type == "cpu"
    return "gguf" if usable and cpu and pack and config.tp_size == 1 else "none"


def _fused_blocks(parts: list[QuantBlocks | None]) -> QuantBlocks | None:
    """A fused linear's blocks: its parts' rows stacked, where every part has blocks of one format."""
    if any(p is None for p in parts) or len({(p.fmt, p.in_features) for p in parts}) != 1:
        return None
    return QuantBlocks(parts[0].fmt, torch.cat([p.blocks for p in parts]), parts[0].in_features)


def layer_blocks(blocks: dict[str, QuantBlocks], layer: int) -> dict[str, QuantBlocks | None]:
    """A decoder layer's fused linears ("qkv_proj", "o_proj", "gate_up_proj", "down_proj") as GGUF blocks (None
    where the file's tensors do not make one)."""
    at = f"model.layers.{layer}"

    def part(name: str) -> QuantBlocks | None:
        return blocks.get(f"{at}.{name}.weight")
    return {"qkv_proj": _fused_blocks([part(f"self_attn.{p}_proj") for p in "qkv"]),
            "o_proj": part("self_attn.o_proj"),
            "gate_up_proj": _fused_blocks([part("mlp.gate_proj"), part("mlp.up_proj")]),
            "down_proj": part("mlp.down_proj")}


def quantize_dense(fmt: str, weight: torch.Tensor) -> QuantBlocks | None:
    """A dense [N, K] weight in `fmt`'s blocks, or None where K is not a multiple of 32."""
    if weight.shape[1] % cpu_gemm_q.BLOCK:
        return None
    return QuantBlocks(fmt, cpu_gemm_q.quantize(fmt, weight), weight.shape[1])


def int8_scale(weight: torch.Tensor) -> torch.Tensor:
    """Per-row absmax / 127 (tp.row_parallel_scales computes them for int8; Q8_0 blocks do not use them)."""
    return weight.detach().float().abs().amax(-1) / 127


@torch.no_grad()
def serve_blocks(model: nn.Module, blocks: dict[str, QuantBlocks], weights: dict[str, torch.Tensor]
                 ) -> tuple[dict[str, int], set[str]]:
    """gguf: every linear (and the LM head) the GGUF's blocks make into a QuantLinear, in place, before the model
    loads its dense weights; returns (weights per format, the HF names the blocks took: the dense copies of those
    are never loaded). A linear's bias comes from `weights` (q/k/v's stacked as qkv_proj's)."""
    counts: dict[str, int] = {}
    taken: set[str] = set()
    parts = {"qkv_proj": [f"self_attn.{p}_proj" for p in "qkv"], "o_proj": ["self_attn.o_proj"],
             "gate_up_proj": ["mlp.gate_proj", "mlp.up_proj"], "down_proj": ["mlp.down_proj"]}
    for i, layer in enumerate(model.layers):
        for name, qb in layer_blocks(blocks, i).items():
            _count(counts, qb)
            if qb is None:
                continue
            names = [f"model.layers.{i}.{p}" for p in parts[name]]
            biases = [weights.get(f"{n}.bias") for n in names]
            bias = None if biases[0] is None else torch.cat(biases).float()
            parent = layer.self_attn if name in ("qkv_proj", "o_proj") else layer.mlp
            setattr(parent, name, QuantLinear(qb.fmt, qb.blocks, qb.in_features, bias))
            taken |= {f"{n}.{kind}" for n in names for kind in ("weight", "bias")}
    head = blocks.get("model.embed_tokens.weight" if model.lm_head is None else "lm_head.weight")
    _count(counts, head)
    if head is not None:
        model.quantized_head = QuantLinear(head.fmt, head.blocks, head.in_features, None)
    _log_dense("gguf", counts)
    return counts, taken


@torch.no_grad()
def quantize_model(model: nn.Module, method: str, row_scales=None) -> dict[str, int]:
    """int8 / int4: swap the decoder's linears (and the LM head) for QuantLinear over the dense weights quantized
    into DENSE_FORMATS[method]'s blocks (the head HEAD_FORMAT's); returns how many weights each format took
    (the dense ones under "dense"). Done once at load, after the model loaded its weights, before the dtype cast:
    from the checkpoint's precision. The dense head weight stays (`lm_head_weight`: the embedding when tied) for
    drafts that borrow it; only the target's own `compute_logits` uses the quantized copy. `row_scales`: unused
    (Q8_0 blocks need no whole-row scales)."""
    del row_scales
    counts: dict[str, int] = {}
    if method not in DENSE_FORMATS:
        return counts
    for layer in model.layers:
        for parent, name in ((layer.self_attn, "qkv_proj"), (layer.self_attn, "o_proj"),
                             (layer.mlp, "gate_up_proj"), (layer.mlp, "down_proj")):
            linear: nn.Linear = getattr(parent, name)
            qb = quantize_dense(DENSE_FORMATS[method], linear.weight)
            _count(counts, qb)
            if qb is not None:
                setattr(parent, name, QuantLinear(qb.fmt, qb.blocks, qb.in_features, linear.bias))
    head = quantize_dense(HEAD_FORMAT, model.lm_head_weight)
    _count(counts, head)
    if head is not None:
        model.quantized_head = QuantLinear(head.fmt, head.blocks, head.in_features, None)
    _log_dense(method, counts)
    return counts


@torch.no_grad()
def quantize_draft(draft: nn.Module) -> dict[str, int]:
    """A draft model's linears (its own head included; not the target's, which it may borrow) -> QuantLinear over
    Q8_0 blocks, in place, where the kernel takes them (SpecConfig.spec_draft_quantization). Returns how many
    weights each format took. A draft forward streams its weights like a target step, so int8 halves what a bf16
    one reads; its precision moves only which tokens it proposes, never what the target's verify commits."""
    counts: dict[str, int] = {}
    for parent in list(draft.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is not nn.Linear or child.weight.device.type != "cpu":
                continue
            usable = cpu_gemm_q.usable(HEAD_FORMAT, child.in_features)
            qb = quantize_dense(HEAD_FORMAT, child.weight) if usable else None
            _count(counts, qb)
            if qb is not None:
                setattr(parent, name, QuantLinear(qb.fmt, qb.blocks, qb.in_features, child.bias))
    _log_dense("draft int8", counts)
    return counts


def _log_dense(method: str, counts: dict[str, int]) -> None:
    if counts.get("dense"):
        logger.info("quantization %s: %d of %d linears stay dense (no blocks the kernel takes)", method,
                    counts["dense"], sum(counts.values()))


def _count(counts: dict[str, int], qb: QuantBlocks | None) -> None:
    key = "dense" if qb is None or not cpu_gemm_q.usable(qb.fmt, qb.in_features) else qb.fmt
    counts[key] = counts.get(key, 0) + 1
