"""The C glue kernels (specpd/kernels/cpu_ops.py) against their torch references: RMSNorm alone and with the
residual add fused in, SiLU(gate) * up; row counts from one (decode) to a prefill chunk, widths of real models,
every dtype."""
import pytest
import torch

from specpd.kernels import cpu_ops

pytestmark = pytest.mark.skipif(not cpu_ops.available(), reason="no C compiler: the glue kernels cannot be built")
TOL = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.float16: dict(atol=2e-3, rtol=2e-3),
       torch.bfloat16: dict(atol=2e-2, rtol=2e-2)}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("rows,width", [(1, 576), (8, 576), (3, 64), (300, 2048), (2, 7)])
def test_rms_norm(dtype, rows, width):
    gen = torch.Generator().manual_seed(rows + width)
    x = (torch.randn(rows, width, generator=gen) * 3).to(dtype)
    res = torch.randn(rows, width, generator=gen).to(dtype)
    w = (1 + 0.1 * torch.randn(width, generator=gen)).to(dtype)
    out, none = cpu_ops.rms_norm(x, w, 1e-5)
    assert none is None
    torch.testing.assert_close(out.float(), cpu_ops.rms_norm_ref(x, w, 1e-5)[0].float(), **TOL[dtype])
    out, summed = cpu_ops.rms_norm(x, w, 1e-6, residual=res)
    want, want_sum = cpu_ops.rms_norm_ref(x, w, 1e-6, residual=res)
    assert torch.equal(summed, want_sum)  # the stream's sum is exactly torch's add
    torch.testing.assert_close(out.float(), want.float(), **TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("rows,inter", [(1, 1536), (64, 1536), (5, 11)])
def test_silu_mul(dtype, rows, inter):
    gen = torch.Generator().manual_seed(rows * inter)
    gu = (torch.randn(rows, 2 * inter, generator=gen) * 4).to(dtype)
    torch.testing.assert_close(cpu_ops.silu_mul(gu).float(), cpu_ops.silu_mul_ref(gu).float(), **TOL[dtype])
    assert cpu_ops.silu_mul(gu.view(1, rows, 2 * inter)).shape == (1, rows, inter)
