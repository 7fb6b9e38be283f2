"""The fp32 GEMM (specpd/kernels/cpu_gemm_f32.py) against its torch reference (float64 sums): ragged row counts
(1..33 and a prefill chunk, tiles of 6 rows and their remainders), widths that are not a multiple of 16 or of
64 (the last column block masked, blocks taken one at a time), SmolLM2's shapes, bias; batch invariance (every
row of an M-row GEMM equals that row alone, bit for bit, at every M and thread count); and PackedLinear taking
it for fp32 at every width."""
import pytest
import torch
import torch.nn.functional as F

from specpd.kernels import cpu_gemm_f32 as gemm_f32
from specpd.kernels.cpu_linear import PackedLinear

pytestmark = pytest.mark.skipif(not gemm_f32.available(), reason="no AVX-512 (or no C compiler) here")


def _weight(n: int, k: int, gen: torch.Generator) -> torch.Tensor:
    return torch.randn(n, k, generator=gen) * 0.05


@pytest.mark.parametrize("n,k", [(960, 576), (576, 1536), (200, 96), (17, 33), (16, 1), (1000, 130)])
@pytest.mark.parametrize("bias", [False, True], ids=["no_bias", "bias"])
def test_gemm_matches_reference(n, k, bias):
    gen = torch.Generator().manual_seed(n * 7 + k)
    w = _weight(n, k, gen)
    b = torch.randn(n, generator=gen) if bias else None
    packed = gemm_f32.pack(w)
    assert packed.shape == ((n + 15) // 16, k, 16)
    for m in (1, 2, 3, 5, 6, 7, 12, 13, 32, 33, 70):
        x = torch.randn(m, k, generator=gen)
        got = gemm_f32.gemm(x, packed, b, n)
        assert got.shape == (m, n) and got.dtype == torch.float32
        # fp32 FMAs in K order against float64 sums: a few fp32 ulps of the row's magnitude
        torch.testing.assert_close(got, gemm_f32.gemm_ref(x, w, b), atol=2e-5, rtol=1e-5)


def test_gemm_strided_input_is_copied_not_misread():
    gen = torch.Generator().manual_seed(3)
    w = _weight(64, 128, gen)
    x = torch.randn(8, 256, generator=gen)[:, ::2]  # non-contiguous view
    torch.testing.assert_close(gemm_f32.gemm(x, gemm_f32.pack(w), None, 64), gemm_f32.gemm_ref(x, w, None),
                               atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_a_row_does_not_depend_on_its_batch_or_threads(threads):
    gen = torch.Generator().manual_seed(11)
    before = torch.get_num_threads()
    w = _weight(3072, 576, gen)
    b = torch.randn(3072, generator=gen)
    packed = gemm_f32.pack(w)
    x = torch.randn(33, 576, generator=gen)
    alone = torch.cat([gemm_f32.gemm(x[i:i + 1], packed, b, 3072) for i in range(33)])
    try:
        torch.set_num_threads(threads)
        for m in (2, 5, 6, 7, 8, 16, 31, 33):
            assert torch.equal(gemm_f32.gemm(x[:m], packed, b, 3072), alone[:m]), (threads, m)
    finally:
        torch.set_num_threads(before)


def test_unpack_inverts_pack():
    gen = torch.Generator().manual_seed(5)
    for n, k in ((17, 33), (960, 576)):
        w = _weight(n, k, gen)
        assert torch.equal(gemm_f32.unpack(gemm_f32.pack(w), n), w)


def test_packed_linear_takes_it_for_fp32_at_every_width():
    gen = torch.Generator().manual_seed(7)
    w, b = _weight(200, 96, gen), torch.randn(200, generator=gen)
    lin = PackedLinear(w, b)
    assert lin.few_rows == gemm_f32.ANY_WIDTH and lin.packed is None  # no oneDNN copy of the weight
    assert torch.equal(lin.weight, w)
    x = torch.randn(300, 96, generator=gen)
    with torch.inference_mode():
        got = lin(x)
    assert torch.equal(got, gemm_f32.gemm(x, lin.few_packed, b, 200))
    torch.testing.assert_close(got, F.linear(x, w, b), atol=2e-5, rtol=1e-5)
