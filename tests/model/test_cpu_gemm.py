"""The few-row CPU GEMM (specpd.kernels.cpu_gemm) against its torch reference, and the model pieces
that route through it (MatmulLinear, the draft layers' nn.Linear, the LM heads)."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from specpd.kernels import cpu_gemm
from specpd.model.llama import MatmulLinear, apply_linear

needs_kernel = pytest.mark.skipif(not cpu_gemm.available(), reason="no C compiler or neither AVX-512 nor AVX2 on this CPU")


@pytest.fixture
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@needs_kernel
@pytest.mark.parametrize("k,n", [(576, 960), (1152, 960), (64, 16), (64, 80), (33, 200), (7, 5), (576, 8192)])
def test_packed_matmul_matches_reference(k, n):
    gen = torch.Generator().manual_seed(k * 1000 + n)
    weight_t = torch.randn(k, n, generator=gen)
    packed = cpu_gemm.pack_weight(weight_t)
    for m in (1, 2, 3, 7, 8, 9, 16, 17, 64):
        x = torch.randn(m, k, generator=gen)
        torch.testing.assert_close(cpu_gemm.packed_matmul(x, packed, n), cpu_gemm.matmul_ref(x, weight_t),
                                   atol=1e-4, rtol=1e-4)


ISAS = [isa for isa in ("avx512", "avx2") if cpu_gemm._cpu_isa() == "avx512" or cpu_gemm._cpu_isa() == isa]


@pytest.mark.skipif(not ISAS, reason="neither AVX-512 nor AVX2 on this CPU")
@pytest.mark.parametrize("isa", ["avx512", "avx2"])
def test_each_isas_kernel_matches_reference(isa):
    """Both variants where the CPU runs them (an AVX-512 CPU runs the AVX2 one too), each on its own panel
    layout: ragged row counts across the row blocks and stream counts (AVX2: 4 streams x 1..3 rows, 3 x 4,
    2 x blocks of up to 6; AVX-512: 8 / 6), past one pass's 64 rows, K across chunks (64) and not a
    multiple of them, a partial last panel, streams left empty."""
    if isa not in ISAS:
        pytest.skip(f"this CPU does not run the {isa} kernel")
    kernel = cpu_gemm.build(isa)
    if kernel is None:
        pytest.skip("no C compiler")
    gen = torch.Generator().manual_seed(7)
    for k, n in [(576, 960), (100, 70), (64, 16), (13, 129), (1536, 200)]:
        weight_t = torch.randn(k, n, generator=gen)
        packed = cpu_gemm.pack_weight(weight_t, isa)
        for m in (1, 2, 3, 4, 5, 6, 7, 8, 9, 12, 13, 17, 64, 65, 130):
            x = torch.randn(m, k, generator=gen)
            torch.testing.assert_close(cpu_gemm.packed_matmul(x, packed, n, kernel=kernel), x @ weight_t,
                                       atol=1e-4, rtol=1e-4)


@needs_kernel
def test_packed_matmul_non_contiguous_input():
    gen = torch.Generator().manual_seed(0)
    weight_t = torch.randn(40, 70, generator=gen)
    x = torch.randn(40, 6, generator=gen).t()  # [6, 40], strided
    torch.testing.assert_close(cpu_gemm.packed_matmul(x, cpu_gemm.pack_weight(weight_t), 70), x @ weight_t,
                               atol=1e-5, rtol=1e-5)


@needs_kernel
@pytest.mark.parametrize("bias", [False, True])
def test_linear_paths_match_f_linear(one_thread, bias):
    gen = torch.Generator().manual_seed(1)
    lin = nn.Linear(48, 100, bias=bias)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(100, 48, generator=gen))
        if bias:
            lin.bias.copy_(torch.randn(100, generator=gen))
    fast = MatmulLinear(lin)
    assert fast.weight_packed is not None
    with torch.inference_mode():
        for m in (1, 2, 5, 8, 16, 33, 64, 65):
            x = torch.randn(m, 48, generator=gen)
            ref = F.linear(x, lin.weight, lin.bias)
            assert cpu_gemm.use_packed(x) == (cpu_gemm.min_rows() <= m <= cpu_gemm.MAX_ROWS)
            torch.testing.assert_close(fast(x), ref, atol=1e-4, rtol=1e-4)
            torch.testing.assert_close(apply_linear(lin, x), ref, atol=1e-4, rtol=1e-4)


@needs_kernel
def test_linear_cache_follows_in_place_updates(one_thread):
    gen = torch.Generator().manual_seed(2)
    weight = torch.randn(64, 32, generator=gen)
    x = torch.randn(4, 32, generator=gen)
    with torch.inference_mode():
        torch.testing.assert_close(cpu_gemm.linear(x, weight), x @ weight.t(), atol=1e-5, rtol=1e-5)
    with torch.no_grad():
        weight.mul_(2.0)
    with torch.inference_mode():
        torch.testing.assert_close(cpu_gemm.linear(x, weight), x @ weight.t(), atol=1e-5, rtol=1e-5)


def test_autograd_never_takes_the_kernel(one_thread):
    lin = nn.Linear(16, 32)
    x = torch.randn(4, 16, requires_grad=True)
    assert not cpu_gemm.use_packed(x)
    apply_linear(lin, x).sum().backward()
    assert x.grad is not None and lin.weight.grad is not None


def test_more_threads_fall_back_to_torch():
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        with torch.inference_mode():
            assert not cpu_gemm.use_packed(torch.randn(4, 8))
    finally:
        torch.set_num_threads(before)


@pytest.mark.skipif(cpu_gemm.build("avx2", bf16=True) is None or "avx2" not in ISAS,
                    reason="no AVX2 kernel (or no compiler) on this CPU")
def test_bf16_weight_variant_is_the_fp32_kernel_bit_for_bit():
    """A weight whose values are bf16 (a draft head exported in bf16, loaded in fp32), packed in bf16: the same
    products in the same order as the fp32 kernel over it, so equal bit for bit; ragged rows, K across chunks,
    a partial last panel."""
    f32, bf16 = cpu_gemm.build("avx2"), cpu_gemm.build("avx2", bf16=True)
    gen = torch.Generator().manual_seed(11)
    for k, n in [(576, 960), (1728, 576), (100, 70), (13, 129)]:
        weight_t = torch.randn(k, n, generator=gen).to(torch.bfloat16).float()
        packed32, packed16 = cpu_gemm.pack_weight(weight_t, "avx2"), cpu_gemm.pack_weight(weight_t, "avx2", torch.bfloat16)
        assert packed16.dtype == torch.bfloat16 and packed16.shape == packed32.shape
        for m in (1, 2, 3, 4, 5, 6, 7, 8, 13, 65):
            x = torch.randn(m, k, generator=gen)
            y16 = cpu_gemm.packed_matmul(x, packed16, n, kernel=bf16)
            assert torch.equal(y16, cpu_gemm.packed_matmul(x, packed32, n, kernel=f32))
            torch.testing.assert_close(y16, x @ weight_t, atol=1e-4, rtol=1e-4)


@needs_kernel
def test_pack_exact_takes_bf16_only_for_bf16_valued_weights():
    gen = torch.Generator().manual_seed(12)
    weight_t = torch.randn(64, 40, generator=gen)
    assert cpu_gemm.pack_exact(weight_t).dtype == torch.float32  # fp32 values: kept
    exact = weight_t.to(torch.bfloat16).float()
    expected = torch.bfloat16 if cpu_gemm._kernel_bf16() is not None else torch.float32
    assert cpu_gemm.pack_exact(exact).dtype == expected
    big = torch.randn(96, 80, generator=gen).to(torch.bfloat16).float()  # past the 4096-value sample
    assert cpu_gemm.pack_exact(big).dtype == expected
    big[-1, -1] += 1e-3  # one fp32 value, after the sample: the whole weight stays fp32
    assert cpu_gemm.pack_exact(big).dtype == torch.float32
    x = torch.randn(3, 64, generator=gen)
    torch.testing.assert_close(cpu_gemm.packed_matmul(x, cpu_gemm.pack_exact(exact), 40), x @ exact,
                               atol=1e-5, rtol=1e-5)
