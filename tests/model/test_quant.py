"""Quantized weights (specpd/model/quant.py): the default GGUF's blocks as the loader keeps them (dequantizing to
its weights, q/k rows un-permuted with them, and given back bit for bit by int4 / int8's quantizer), QuantLinear
against the kernel's torch reference, and what `--quantization` resolves to or refuses."""
import pytest
import torch

from specpd.config import CacheConfig, EngineConfig
from specpd.engine.llm_engine import LLMEngine
from specpd.kernels import cpu_gemm_q
from specpd.kernels.cpu_linear import QuantLinear
from specpd.model import quant
from specpd.model.loader import load_checkpoint

pytestmark = pytest.mark.skipif(not cpu_gemm_q.available(), reason="no quantized kernel here (AVX2 / a C compiler)")


@pytest.fixture(scope="module")
def ckpt():
    return load_checkpoint("default")


def test_the_default_gguf_blocks_dequantize_to_its_weights(ckpt):
    """Every Q4_1 linear and the Q8_0 embedding: the kept blocks are the loaded weights, exactly (q / k rows
    un-permuted as whole rows: a wrong row order would mismatch here)."""
    assert {b.fmt for b in ckpt.blocks.values()} == {"Q4_1", "Q8_0"}
    assert len(ckpt.blocks) == 30 * 7 + 1 and ckpt.blocks["model.embed_tokens.weight"].fmt == "Q8_0"
    for name, qb in ckpt.blocks.items():
        assert torch.equal(qb.dequantize(), ckpt.weights[name].float()), name


def test_int4_and_int8_give_back_the_gguf_blocks(ckpt):
    """llama.cpp's reference quantizer on the dequantized weights recovers the file's blocks bit for bit (Q4_1:
    each block's min at code 0 and max at 15; Q8_0: its absmax at +-127), so int4 on the GGUF serves what gguf
    does. Three layers and the head keep the test fast; all 211 matrices were checked once the same way."""
    names = [n for n in ckpt.blocks if n.split(".")[2:3] in (["0"], ["15"], ["29"])] + ["model.embed_tokens.weight"]
    assert len(names) == 3 * 7 + 1
    for name in names:
        qb = ckpt.blocks[name]
        assert torch.equal(cpu_gemm_q.quantize(qb.fmt, ckpt.weights[name]), qb.blocks), name


def test_fused_linears_stack_their_parts_blocks(ckpt):
    fused = quant.layer_blocks(ckpt.blocks, 3)
    q, k, v = (ckpt.blocks[f"model.layers.3.self_attn.{p}_proj.weight"] for p in "qkv")
    assert torch.equal(fused["qkv_proj"].blocks, torch.cat([q.blocks, k.blocks, v.blocks]))
    assert fused["gate_up_proj"].out_features == 2 * 1536 and fused["down_proj"].in_features == 1536
    mixed = dict(ckpt.blocks)
    mixed["model.layers.3.self_attn.v_proj.weight"] = quant.quantize_dense("Q8_0", ckpt.weights[
        "model.layers.3.self_attn.v_proj.weight"])
    assert quant.layer_blocks(mixed, 3)["qkv_proj"] is None  # parts of two formats: the fused linear stays dense


@pytest.mark.parametrize("fmt", tuple(cpu_gemm_q.FORMATS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_quant_linear_matches_the_kernels_reference(fmt, dtype):
    gen = torch.Generator().manual_seed(1)
    weight, bias = torch.randn(200, 96, generator=gen) * 0.05, torch.randn(200, generator=gen)
    blocks = cpu_gemm_q.quantize(fmt, weight)
    layer = QuantLinear(fmt, blocks, 96, bias)
    assert torch.equal(layer.dequantized(), cpu_gemm_q.dequantize(fmt, blocks, 96))
    for rows in (1, 5, 16, 130):
        x = torch.randn(2, rows, 96, generator=gen).to(dtype)  # a leading batch dim, flattened
        with torch.inference_mode():
            out = layer(x)
        assert out.shape == (2, rows, 200) and out.dtype == dtype
        ref = cpu_gemm_q.gemm_ref(x.reshape(-1, 96).double(), fmt, blocks, bias).view(2, rows, 200)
        torch.testing.assert_close(out.double(), ref, atol=1e-4, rtol=2 ** -8 if dtype == torch.bfloat16 else 1e-5)
    x = torch.randn(3, 96, requires_grad=True)  # autograd: F.linear over the dequantized weight
    layer(x).sum().backward()
    torch.testing.assert_close(x.grad, layer.dequantized().sum(0).expand(3, 96))


def _config(**kw) -> EngineConfig:
    return EngineConfig(model="default", cache=CacheConfig(num_pages=8), **kw)


def test_auto_means_gguf_for_a_gguf_and_none_elsewhere(ckpt, monkeypatch):
    monkeypatch.delenv("SPECPD_AUTO_QUANTIZATION", raising=False)
    assert quant.resolve(_config(), ckpt.blocks) == "gguf"
    assert quant.resolve(_config(), {}) == "none"  # an HF directory: no blocks
    assert quant.resolve(_config(), ckpt.blocks, pack=False) == "none"  # a draft trainer's frozen nn.Linear target
    assert quant.resolve(_config(tp_size=3), ckpt.blocks) == "none"
    assert quant.resolve(_config(quantization="int8"), {}) == "int8"
    monkeypatch.setenv("SPECPD_AUTO_QUANTIZATION", "none")
    assert quant.resolve(_config(), ckpt.blocks) == "none"


@pytest.mark.parametrize("kw,match", [
    (dict(quantization="int3"), "quantization must be one of"),
    (dict(quantization="int4", device="cuda"), "implemented for device='cpu' only"),
    (dict(quantization="gguf", tp_size=3), "at tp_size 1 only"),
])
def test_what_quantization_cannot_do_is_refused(ckpt, kw, match):
    with pytest.raises(ValueError, match=match):
        LLMEngine(_config(**kw), checkpoint=ckpt)


def test_gguf_needs_a_checkpoint_with_blocks(ckpt):
    with pytest.raises(ValueError, match="needs a GGUF checkpoint"):
        quant.resolve(_config(quantization="gguf"), {})
