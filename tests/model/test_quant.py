"""Weight-only quantization: the kernels against pure-torch dequantized references, Q4_1 round trips,
and an engine smoke test on SmolLM2 (int4 greedy output tracks dense bf16)."""
import pytest
import torch

from specpd.config import CacheConfig, EngineConfig
from specpd.core import SamplingParams
from specpd.engine.llm_engine import LLMEngine
from specpd.model.loader import load_checkpoint
from specpd.model.quant import (DENSE_ROWS, Int4Linear, Int8Linear, dequantize_int4, quantize_int4,
                                quantize_int8)


@pytest.fixture(scope="module")
def ckpt():
    return load_checkpoint("default")


def random_q4_1(n: int, k: int, seed: int = 0):
    """What llama.cpp's Q4_1 writes: per 32-block fp16 d and m, codes 0..15 with 0 and 15 both used."""
    gen = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 16, (n, k // 32, 32), generator=gen)
    codes[:, :, 0], codes[:, :, 1] = 0, 15
    codes = codes[:, :, torch.randperm(32, generator=gen)]
    d = (torch.rand(n, k // 32, generator=gen) * 0.02 + 1e-3).half()
    m = (-torch.rand(n, k // 32, generator=gen) * 0.1).half()
    weight = (codes.float() * d.float().unsqueeze(-1) + m.float().unsqueeze(-1)).view(n, k)  # gguf's dequant
    return weight, codes.view(n, k), d, m


def test_int4_recovers_q4_1_blocks_exactly():
    weight, codes, d, m = random_q4_1(48, 128)
    got_codes, scale, low = quantize_int4(weight)
    assert torch.equal(got_codes.long(), codes)
    assert torch.equal(scale.half(), d) and torch.equal(low, m.float())
    assert torch.equal(dequantize_int4(got_codes, scale.half().float(), low), weight)


def test_int4_recovers_the_default_gguf(ckpt):
    """SmolLM2's Q4_1 layer blocks (un-permuted q/k rows included) come back bit-exact. Three layers
    keep the test fast; all 30 were checked once the same way."""
    layers = {n: w for n, w in ckpt.weights.items() if n.split(".")[2:3] in (["0"], ["15"], ["29"]) and w.dim() == 2}
    assert len(layers) == 3 * 7
    for name, w in layers.items():
        codes, scale, low = quantize_int4(w)
        assert torch.equal(dequantize_int4(codes, scale.half().float(), low), w), name


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("rows", [1, 5, 16, DENSE_ROWS + 3])  # the int4 kernel, then the dense path
def test_int4_linear_matches_dequantized_reference(rows, bias):
    torch.manual_seed(0)
    weight = torch.randn(96, 128) * 0.05
    b = torch.randn(96) * 0.1 if bias else None
    layer = Int4Linear(weight, b)
    codes, scale, low = quantize_int4(weight)
    # the quantization itself: at most half a step from the float weight
    steps = scale.repeat_interleave(32, dim=1)  # [N, K]
    assert ((dequantize_int4(codes, scale, low) - weight).abs() <= steps / 2 + 1e-6).all()
    # the kernel keeps scale and zero (the value of code 8) in bf16
    zero = (low + 8 * scale).bfloat16().float()
    scale = scale.bfloat16().float()
    ref_weight = dequantize_int4(codes, scale, zero - 8 * scale)
    assert torch.equal(layer.dequantized(), ref_weight)
    x = torch.randn(rows, 128).bfloat16()
    ref = x.float() @ ref_weight.t() + (b.bfloat16().float() if bias else 0)
    out = layer(x)
    assert out.dtype == torch.bfloat16 and out.shape == (rows, 96)
    # bf16 output: one rounding of a value of size |ref| (2^-8 relative), plus accumulation order
    torch.testing.assert_close(out.float(), ref, atol=2e-2, rtol=1e-2)


@pytest.mark.parametrize("rows", [1, 16, DENSE_ROWS])
def test_int8_linear_matches_dequantized_reference(rows):
    torch.manual_seed(1)
    weight = torch.randn(80, 96) * 0.05
    layer = Int8Linear(weight, None)
    codes, scale = quantize_int8(weight)
    ref_weight = codes.float() * scale.bfloat16().float().unsqueeze(1)
    assert torch.equal(layer.dequantized(), ref_weight)
    x = torch.randn(rows, 96).bfloat16()
    torch.testing.assert_close(layer(x).float(), x.float() @ ref_weight.t(), atol=2e-2, rtol=1e-2)
    assert ((codes.float() * scale.unsqueeze(1) - weight).abs() <= scale.unsqueeze(1) / 2 + 1e-7).all()


def test_quantization_needs_bf16_and_a_known_method(ckpt):
    with pytest.raises(ValueError, match="needs dtype='bfloat16'"):
        LLMEngine(EngineConfig(model="default", quantization="int4", cache=CacheConfig(num_pages=8)), checkpoint=ckpt)
    with pytest.raises(ValueError, match="quantization must be one of"):
        LLMEngine(EngineConfig(model="default", dtype="bfloat16", quantization="int3", cache=CacheConfig(num_pages=8)),
                  checkpoint=ckpt)


QUESTIONS = ["What is the capital of France?", "Write a Python function that reverses a string.",
             "List three colors.", "Explain how a hash map works.", "Give me a recipe for pancakes.",
             "What causes the seasons on Earth?", "Summarize the plot of Hamlet in two sentences.",
             "How do I sort a list in Python?"]


@pytest.fixture
def restore_threads():
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


def test_int4_engine_tracks_bf16_on_smollm2(ckpt, restore_threads):
    """int4 reproduces the GGUF's Q4_1 layer weights (bf16 scales) and uses an int8 head, so it differs
    from dense bf16 by rounding only; greedy decoding still drifts apart once two logits are within
    that rounding (dense bf16 vs fp32 does too: it differs at token 0 of the first prompt).
    Tolerance: >= 60% of all tokens lie in the common prefixes, and the first token agrees on every prompt but
    the first, whose token 0 is a near-tie at bf16 precision (dense bf16 and fp32 differ there too) (measured
    with the oneDNN / fused-kernel core: 0, 16, 16 of 16 on the first three prompts; before it 16, 8, 16; with an
    int4 head 5, 8, 6; with bf16 attention on AMX tiles 0, 8, 16, so eight prompts now, where one near-tie moves
    the sum by a few percent: 0, 16, 9, 16, 16, 16, 16, 16 on tiles, 16, 8, 16, ... 16 without)."""
    tok = ckpt.tokenizer
    prompts = [tok.encode(tok.apply_chat_template([{"role": "user", "content": q}])) for q in QUESTIONS]
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    outs = {}
    for quant in ("none", "int4"):
        # one thread: two OpenMP threads on a busy 2-core CI box run this 4x slower
        engine = LLMEngine(EngineConfig(model="default", dtype="bfloat16", quantization=quant, num_threads=1,
                                        cache=CacheConfig(page_size=16, num_pages=64)), checkpoint=ckpt)
        outs[quant] = [o.token_ids for o in engine.generate(prompts, params)]
        assert engine.free_pages == 64
    assert torch.get_num_threads() == 1
    prefixes = [next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), len(a))
                for a, b in zip(outs["int4"], outs["none"])]
    assert min(prefixes[1:]) >= 1, prefixes
    assert sum(prefixes) >= 0.6 * len(prompts) * params.max_tokens, prefixes
