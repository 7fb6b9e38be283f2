"""The quantized-weight GEMM (specpd/kernels/cpu_gemm_q.py) against its torch reference, per GGUF format (Q4_0,
Q4_1, Q8_0): blocks that gguf-py dequantizes alike and that pack / unpack round-trips; ragged row counts (tiles of
16 rows and their remainders, a prefill chunk), widths that are not a multiple of the 16-column group, K from one
block to SmolLM2's 1536, bias, fp32 and bf16 activations, strided rows; the bound on the activation's rounding
against F.linear over the dequantized weight; batch invariance (a row alone equals that row inside any batch, at
every thread count); and the AVX2 build (x86-64-v3, in a child process) computing the same bits as this CPU's."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType
from gguf.quants import dequantize as gguf_dequantize

from specpd.kernels import cpu_gemm_q as gq

pytestmark = pytest.mark.skipif(not gq.available(), reason="no AVX2 + FMA + F16C (or no C compiler) here")
FORMATS = tuple(gq.FORMATS)
U = 2.0 ** -24  # fp32's unit roundoff


def random_blocks(fmt: str, n: int, k: int, gen: torch.Generator) -> torch.Tensor:
    """GGUF blocks of a random weight, as llama.cpp's quantizer writes them; Q8_0 also gets -128 codes (a file may
    hold them) and a few all-zero blocks."""
    w = torch.randn(n, k, generator=gen) * 0.05
    w[:, :32] *= 8  # blocks of several magnitudes
    if n > 3 and k > 32:
        w[1, 32:64] = 0
    blocks = gq.quantize(fmt, w)
    if fmt == "Q8_0":
        raw = blocks.view(n, k // 32, 34)
        raw[:, :, 2 + 5] = torch.tensor(-128, dtype=torch.int8).view(torch.uint8)
    return blocks


def tolerance(fmt: str, x: torch.Tensor, blocks: torch.Tensor) -> torch.Tensor:
    """How far the kernel's fp32 sums may be from the float64 reference: a rounding per block step (the scale
    product, the fused multiply-add, Q4_1's min term) over the sum of the terms' magnitudes."""
    k = x.shape[1]
    codes, scale = gq.quantize_rows_ref(x)
    xd = (codes.double().view(x.shape[0], -1, 32) * scale.double().unsqueeze(-1)).view(x.shape[0], k)
    d, m, q = gq._fields(fmt, blocks)
    w = d.double().abs().unsqueeze(-1) * (q - 8 if fmt == "Q4_0" else q).double().abs()
    if m is not None:
        w = w + m.double().abs().unsqueeze(-1)
    return (k // 32 + 4) * U * F.linear(xd.abs(), w.view(blocks.shape[0], k))


def check(got: torch.Tensor, x: torch.Tensor, fmt: str, blocks: torch.Tensor, bias: torch.Tensor | None) -> None:
    ref = gq.gemm_ref(x.double(), fmt, blocks, bias)  # float64: the exact sums of the quantized operands
    tol = tolerance(fmt, x.float(), blocks)
    if got.dtype == torch.bfloat16:  # one rounding to bf16: half a unit in its 8-bit mantissa
        tol = tol + 2.0 ** -8 * (ref.abs() + tol)
    err = (got.double() - ref).abs()
    assert (err <= tol + 1e-30).all(), f"{fmt}: max error {err.max():.3g}, allowed {tol.flatten()[err.argmax()]:.3g}"


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("n,k", [(17, 32), (200, 96), (960, 576), (576, 1536)])
def test_blocks_dequantize_as_gguf_and_pack_round_trips(fmt, n, k):
    gen = torch.Generator().manual_seed(n + k)
    blocks = random_blocks(fmt, n, k, gen)
    expect = gguf_dequantize(blocks.numpy(), GGMLQuantizationType(gq.FORMATS[fmt])).reshape(n, k)
    assert torch.equal(gq.dequantize(fmt, blocks, k), torch.from_numpy(expect))
    packed = gq.pack(fmt, blocks, k)
    assert packed.numel() == -(-n // 16) * 16 * k // 32 * gq.BLOCK_BYTES[fmt]  # the file's bytes, 16-col groups
    assert torch.equal(gq.unpack(fmt, packed, n, k), blocks)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("n,k,bias", [(200, 96, True), (17, 32, False), (960, 576, False), (576, 1536, True)])
def test_gemm_matches_reference(fmt, dtype, n, k, bias):
    gen = torch.Generator().manual_seed(n * 7 + k)
    blocks = random_blocks(fmt, n, k, gen)
    b = torch.randn(n, generator=gen) if bias else None
    packed = gq.pack(fmt, blocks, k)
    for m in (1, 2, 3, 5, 8, 13, 16, 17, 32, 64, 200, 512):
        if m == 512 and k > 576:
            continue  # the float64 reference's cost; 512 rows run at K = 576 and below
        x = (torch.randn(m, k, generator=gen) * 2).to(dtype)
        if m > 3:
            x[2] = 0  # an all-zero row: every block's scale 0
        got = gq.gemm(x, fmt, packed, b, n)
        assert got.shape == (m, n) and got.dtype == dtype
        check(got, x, fmt, blocks, b)


@pytest.mark.parametrize("fmt", FORMATS)
def test_gemm_is_within_the_activation_rounding_of_the_dense_weight(fmt):
    """Against F.linear over the dequantized fp32 weight and the unquantized x, the only difference is x's
    rounding to its int8 grid: at most half a step (dx / 2) per input, so |y - F.linear(x, W)| <=
    F.linear(dx / 2, |W|) (plus fp32 rounding)."""
    gen = torch.Generator().manual_seed(5)
    n, k = 300, 576
    blocks = random_blocks(fmt, n, k, gen)
    w = gq.dequantize(fmt, blocks, k)
    x = torch.randn(40, k, generator=gen)
    _, scale = gq.quantize_rows_ref(x)
    half_step = (scale / 2).repeat_interleave(32, dim=1)
    bound = F.linear(half_step.double(), w.double().abs()) + tolerance(fmt, x, blocks) + 1e-5
    err = (gq.gemm(x, fmt, gq.pack(fmt, blocks, k), None, n).double() - F.linear(x.double(), w.double())).abs()
    assert (err <= bound).all()
    # and the bound is not vacuous: the typical error is a small fraction of the output's size
    assert err.mean() < 0.02 * F.linear(x, w).abs().mean()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_strided_rows_are_read_in_place_and_other_strides_copied(dtype):
    gen = torch.Generator().manual_seed(3)
    n, k = 64, 128
    blocks = random_blocks("Q4_1", n, k, gen)
    packed = gq.pack("Q4_1", blocks, k)
    wide = torch.randn(9, 3 * k, generator=gen).to(dtype)
    for x in (wide[:, k:2 * k], wide[::2, :k], wide[:, ::3]):  # scattered rows, every other row, strided columns
        assert not x.is_contiguous()
        assert torch.equal(gq.gemm(x, "Q4_1", packed, None, n), gq.gemm(x.contiguous(), "Q4_1", packed, None, n))
        check(gq.gemm(x, "Q4_1", packed, None, n), x, "Q4_1", blocks, None)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("threads", [1, 2, 3])
def test_a_row_does_not_depend_on_its_batch_or_threads(fmt, threads):
    gen = torch.Generator().manual_seed(11)
    n, k = 1000, 576
    blocks = random_blocks(fmt, n, k, gen)
    b = torch.randn(n, generator=gen)
    packed = gq.pack(fmt, blocks, k)
    x = torch.randn(40, k, generator=gen)
    alone = torch.cat([gq.gemm(x[i:i + 1], fmt, packed, b, n) for i in range(40)])
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(threads)
        for m in (2, 5, 8, 15, 16, 17, 33, 40):
            assert torch.equal(gq.gemm(x[:m], fmt, packed, b, n), alone[:m]), (threads, m)
        shuffled = torch.randperm(40, generator=gen)  # the same rows beside other rows, in another order
        assert torch.equal(gq.gemm(x[shuffled], fmt, packed, b, n), alone[shuffled])
    finally:
        torch.set_num_threads(before)


def test_what_the_kernel_cannot_take_is_refused():
    assert not gq.usable("Q4_1", 48) and not gq.usable("Q5_0", 64) and gq.usable("Q8_0", 64)
    with pytest.raises(ValueError, match="K a multiple of 32"):
        gq.pack("Q4_1", torch.zeros(4, 30, dtype=torch.uint8), 48)
    with pytest.raises(ValueError, match="takes"):
        gq.pack("Q5_0", torch.zeros(4, 22, dtype=torch.uint8), 32)
    off = subprocess.run([sys.executable, "-c", "from specpd.kernels import cpu_gemm_q as g; print(g.available())"],
                         env={**os.environ, "SPECPD_C_KERNELS": "0"}, capture_output=True, text=True, timeout=120)
    assert off.stdout.strip() == "False", off.stderr[-2000:]


def _sample_outputs() -> dict:
    """Every format at a few shapes on fixed inputs (the cross-build comparison's cases)."""
    gen = torch.Generator().manual_seed(21)
    out = {}
    for fmt in FORMATS:
        for n, k in ((200, 96), (960, 576), (576, 1536)):
            blocks = random_blocks(fmt, n, k, gen)
            packed, b = gq.pack(fmt, blocks, k), torch.randn(n, generator=gen)
            for m in (1, 3, 8, 21):
                x = torch.randn(m, k, generator=gen)
                out[f"{fmt}-{n}-{k}-{m}"] = gq.gemm(x, fmt, packed, b, n)
                out[f"{fmt}-{n}-{k}-{m}-bf16"] = gq.gemm(x.bfloat16(), fmt, packed, None, n)
    return out


@pytest.mark.parametrize("march", ["x86-64-v3", "skylake-avx512"])
def test_the_avx2_build_computes_the_same_bits(march, tmp_path):
    """The AVX2 path (vpmaddubsw) built for x86-64-v3, and for an AVX-512 CPU without VNNI (which takes the AVX2
    path), run in a child process: the reference tests pass there and its outputs equal this build's bit for bit."""
    from specpd.machine import cpu_flags
    need = {"x86-64-v3": {"avx2", "fma", "f16c"}, "skylake-avx512": {"avx512f", "avx512bw", "avx512vl", "avx512dq"}}
    if not need[march] <= cpu_flags():
        pytest.skip(f"this CPU cannot run a {march} build")
    env = {**os.environ, "SPECPD_KERNEL_MARCH": march}
    probe = ("import sys, torch; sys.path.insert(0, %r); from test_cpu_gemm_q import _sample_outputs; "
             "from specpd.kernels import cpu_gemm_q as g; assert g.path() == 'avx2', g.path(); "
             "torch.save(_sample_outputs(), %r)") % (os.path.dirname(__file__), str(tmp_path / "avx2.pt"))
    proc = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    theirs, ours = torch.load(tmp_path / "avx2.pt"), _sample_outputs()
    assert theirs.keys() == ours.keys()
    assert all(torch.equal(theirs[key], ours[key]) for key in ours), [k for k in ours if not torch.equal(theirs[k], ours[k])]
    if march == "x86-64-v3":
        tests = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__, "-x", "-k",
                                "matches_reference or does_not_depend"], env=env, capture_output=True, text=True,
                               timeout=600)
        assert tests.returncode == 0, tests.stdout[-3000:] + tests.stderr[-3000:]
