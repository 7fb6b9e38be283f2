"""The few-row bf16 GEMM (specpd/kernels/cpu_gemm_bf16.py) against its torch reference: ragged row counts
(1..33, tiles of 6 or 8 rows and their remainders), widths that are not a multiple of 16 or of 64 (the last column
block masked, blocks taken one at a time), SmolLM2's shapes, bias, thread counts; and batch invariance: every
row of an M-row GEMM equals that row alone, bit for bit, at every M and thread count. Each on both paths where
the CPU has AMX: the tile path (inputs a multiple of 32; row tiles of 16 and their remainders) and the vdpbf16ps
one (the others, and every GEMM with the tiles off)."""
import pytest
import torch

from specpd.kernels import cpu_gemm_bf16 as gemm_bf16
from specpd.kernels.build import gemm_amx_wanted
from specpd.machine import isa

pytestmark = pytest.mark.skipif(not gemm_bf16.available(), reason="no AVX512-BF16 (or no C compiler) here")
AMX = gemm_bf16.available() and isa() == "amx"


@pytest.fixture(params=["vector", "amx"])
def path(request):
    """The kernel library's path for the test: vdpbf16ps, or AMX tiles (where the CPU has them)."""
    if request.param == "amx" and not AMX:
        pytest.skip("no AMX here")
    lib = gemm_bf16._lib()
    assert lib.specpd_gemm_bf16_use_amx(int(request.param == "amx")) == (request.param == "amx")
    yield request.param
    lib.specpd_gemm_bf16_use_amx(int(lib.amx))


def _weight(n: int, k: int, gen: torch.Generator) -> torch.Tensor:
    return (torch.randn(n, k, generator=gen) * 0.05).to(torch.bfloat16)


@pytest.mark.parametrize("n,k", [(960, 576), (576, 1536), (200, 96), (17, 34), (16, 2), (1000, 130), (40, 64)])
@pytest.mark.parametrize("bias", [False, True], ids=["no_bias", "bias"])
def test_gemm_matches_reference(n, k, bias, path):
    gen = torch.Generator().manual_seed(n * 7 + k)
    w = _weight(n, k, gen)
    b = torch.randn(n, generator=gen) if bias else None
    packed = gemm_bf16.pack(w)
    assert packed.shape == ((n + 15) // 16, k // 2, 16, 2)
    for m in (1, 2, 3, 5, 6, 7, 12, 13, 16, 17, 32, 33, 47):
        x = torch.randn(m, k, generator=gen).to(torch.bfloat16)
        got = gemm_bf16.gemm(x, packed, b, n)
        want = gemm_bf16.gemm_ref(x, w, b)
        assert got.shape == (m, n) and got.dtype == torch.bfloat16
        # the same fp32 sums in another order, then one bf16 rounding: at most one bf16 step apart
        torch.testing.assert_close(got.float(), want.float(), atol=1e-2, rtol=8e-3)


def test_gemm_strided_input_is_copied_not_misread(path):
    gen = torch.Generator().manual_seed(3)
    w = _weight(64, 128, gen)
    packed = gemm_bf16.pack(w)
    x = torch.randn(8, 256, generator=gen).to(torch.bfloat16)[:, ::2]  # non-contiguous view
    torch.testing.assert_close(gemm_bf16.gemm(x, packed, None, 64).float(), gemm_bf16.gemm_ref(x, w, None).float(),
                               atol=1e-2, rtol=8e-3)


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_a_row_does_not_depend_on_its_batch_or_threads(threads, path):
    gen = torch.Generator().manual_seed(11)
    before = torch.get_num_threads()
    w = _weight(3072, 576, gen)
    b = torch.randn(3072, generator=gen)
    packed = gemm_bf16.pack(w)
    x = torch.randn(33, 576, generator=gen).to(torch.bfloat16)
    alone = torch.cat([gemm_bf16.gemm(x[i:i + 1], packed, b, 3072) for i in range(33)])
    try:
        torch.set_num_threads(threads)
        for m in (2, 5, 6, 7, 8, 15, 16, 17, 31, 33):
            assert torch.equal(gemm_bf16.gemm(x[:m], packed, b, 3072), alone[:m]), (threads, m)
    finally:
        torch.set_num_threads(before)


def test_odd_width_is_refused():
    with pytest.raises(ValueError, match="odd"):
        gemm_bf16.pack(torch.zeros(16, 7, dtype=torch.bfloat16))


def test_unpack_inverts_pack():
    gen = torch.Generator().manual_seed(5)
    for n, k in ((17, 34), (960, 576)):
        w = _weight(n, k, gen)
        assert torch.equal(gemm_bf16.unpack(gemm_bf16.pack(w), n), w)


@pytest.mark.skipif(not (AMX and gemm_amx_wanted()), reason="no AMX here, or SPECPD_GEMM_AMX=0")
def test_an_amx_cpu_multiplies_on_tiles_and_they_round_apart_from_vdpbf16ps():
    """The process takes the tile path where the CPU has AMX (build.gemm_amx_wanted), and the switch reaches
    another computation: the two paths round some sums apart (both are checked against the reference above)."""
    assert gemm_bf16._lib().amx
    gen = torch.Generator().manual_seed(13)
    w = _weight(3072, 576, gen)
    x = torch.randn(16, 576, generator=gen).to(torch.bfloat16)
    packed, lib = gemm_bf16.pack(w), gemm_bf16._lib()
    tiles = gemm_bf16.gemm(x, packed, None, 3072)
    try:
        lib.specpd_gemm_bf16_use_amx(0)
        assert not torch.equal(tiles, gemm_bf16.gemm(x, packed, None, 3072))
    finally:
        lib.specpd_gemm_bf16_use_amx(1)
