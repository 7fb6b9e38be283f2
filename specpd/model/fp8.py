"""FP8 block-quantized checkpoints (DeepSeek-V3 / R1's release, GLM-4.5-FP8), dequantized at load.

Such a checkpoint stores a linear's weight W [out, in] as float8_e4m3fn codes and, beside it, `<name>_scale_inv`
[ceil(out / 128), ceil(in / 128)] fp32: block (i, j) of 128 x 128 weights is codes * scale_inv[i, j]
(config.json quantization_config: quant_method "fp8", weight_block_size [128, 128]). The loader reads the codes
into the load dtype (every e4m3 value is exact there) and this multiplies each block by its scale, so the model
holds plain weights in its own dtype: no FP8 arithmetic happens at run time.
"""
from __future__ import annotations

import torch

SCALE_SUFFIX = "_scale_inv"


def dequantize_fp8(weights: dict[str, torch.Tensor], block: tuple[int, int] = (128, 128)) -> dict[str, torch.Tensor]:
    """`weights` with every `X.weight_scale_inv` applied to `X.weight` and dropped (the same dict when there are
    none). `block`: the checkpoint's weight_block_size."""
    scales = [k for k in weights if k.endswith(SCALE_SUFFIX)]
    if not scales:
        return weights
    out = dict(weights)
    for key in scales:
        scale = out.pop(key).float()
        name = key[:-len(SCALE_SUFFIX)]
        if name not in out:
            raise ValueError(f"FP8 scale {key!r} has no weight {name!r} beside it")
        codes = out[name]
        rows, cols = codes.shape
        if scale.shape != (-(-rows // block[0]), -(-cols // block[1])):
            raise ValueError(f"FP8 scale {key!r} is {tuple(scale.shape)} for a {rows}x{cols} weight in "
                             f"{block[0]}x{block[1]} blocks")
        full = scale.repeat_interleave(block[0], 0)[:rows].repeat_interleave(block[1], 1)[:, :cols]
        out[name] = (codes.float() * full).to(torch.float32 if codes.element_size() == 1 else codes.dtype)
    return out
