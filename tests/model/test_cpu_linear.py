"""PackedLinear (specpd/kernels/cpu_linear.py) against F.linear over the original weight: every row count a
step uses (1 = decode, 2..64 verify / batched decode, a prefill chunk), bias or not, fp32 and bf16, 1-D / 3-D
inputs; pack_linears swaps a model's nn.Linear layers and leaves everything else alone."""
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from specpd.kernels import cpu_gemm_bf16
from specpd.kernels.cpu_linear import PackedLinear, mkldnn_ok, pack_linears

TOL = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.bfloat16: dict(atol=3e-2, rtol=2e-2)}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("bias", [False, True], ids=["no_bias", "bias"])
def test_packed_linear_matches_f_linear(dtype, bias):
    if not mkldnn_ok(dtype):
        pytest.skip(f"oneDNN does not run {dtype} here")
    gen = torch.Generator().manual_seed(0)
    lin = nn.Linear(96, 200, bias=bias).to(dtype)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(200, 96, generator=gen) * 0.1)
        if bias:
            lin.bias.copy_(torch.randn(200, generator=gen))
    packed = PackedLinear.from_linear(lin)
    torch.testing.assert_close(packed.weight.float(), lin.weight.float(), atol=0, rtol=0)
    for m in (1, 2, 3, 7, 8, 16, 33, 64, 65, 300):
        x = torch.randn(m, 96, generator=gen).to(dtype)
        want = F.linear(x.float(), lin.weight.float(), None if lin.bias is None else lin.bias.float())
        with torch.inference_mode():
            torch.testing.assert_close(packed(x).float(), want, **TOL[dtype])
    x3 = torch.randn(2, 5, 96, generator=gen).to(dtype)
    with torch.inference_mode():
        assert packed(x3).shape == (2, 5, 200)
        torch.testing.assert_close(packed(x3).float(), F.linear(x3.float(), lin.weight.float(),
                                                                None if lin.bias is None else lin.bias.float()),
                                   **TOL[dtype])


def test_pack_linears_swaps_only_linears():
    if not mkldnn_ok(torch.float32):
        pytest.skip("no oneDNN")
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Sequential(nn.Linear(8, 4, bias=False), nn.LayerNorm(4)))
    x = torch.randn(3, 8)
    with torch.inference_mode():
        want = model(x)
    assert pack_linears(model) == 2
    assert [type(m).__name__ for m in model.modules()].count("PackedLinear") == 2
    assert isinstance(model[1], nn.ReLU) and isinstance(model[2][1], nn.LayerNorm)
    with torch.inference_mode():
        torch.testing.assert_close(model(x), want, atol=1e-6, rtol=1e-6)


BF16_WIDEST = min(cpu_gemm_bf16.max_rows(), 600) if cpu_gemm_bf16.available() else 32


@pytest.mark.parametrize("dtype,widest", [(torch.float32, 600), (torch.bfloat16, BF16_WIDEST)], ids=str)
def test_a_row_does_not_depend_on_its_batch(dtype, widest):
    """Batch invariance (cpu_linear's docstring): each row of an M-row GEMM equals that row computed alone, for
    every M up to `widest` (fp32: any; bf16: the few-row kernel's width where it runs, any unless
    SPECPD_GEMM_AMX=0 on AMX, else oneDNN's kernel for up to 32 rows), on SmolLM2's shapes."""
    if not mkldnn_ok(dtype):
        pytest.skip(f"oneDNN does not run {dtype} here")
    gen = torch.Generator().manual_seed(1)
    for out_f, in_f in ((960, 576), (576, 1536), (3072, 576)):
        lin = PackedLinear((torch.randn(out_f, in_f, generator=gen) * 0.05).to(dtype), None)
        x = torch.randn(widest, in_f, generator=gen).to(dtype)
        with torch.inference_mode():
            alone = torch.cat([lin(x[i:i + 1]) for i in range(widest)])
            for m in sorted({2, 3, 8, 16, 32, 64, 65, 300, widest} & set(range(2, widest + 1))):
                assert torch.equal(lin(x[:m]), alone[:m]), (out_f, in_f, m)
