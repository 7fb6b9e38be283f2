"""Compile a kernel's C source once per machine and load it with ctypes (no torch headers, ~1 s with gcc).

The library is built with `-O3 -march=native` (so it uses the CPU's widest vectors: AVX-512 / AMX boxes,
AVX2 ones) and OpenMP; it lands in $SPECPD_CACHE/kernels/ under a name keyed by the source, the flags and
this CPU's feature flags, so a cache directory shared by two machines never hands one the other's code.
OpenMP: the library links libgomp by its soname, which torch has already loaded from its own lib/ (import
torch first), so the kernels and torch share one thread pool and torch.set_num_threads governs both.
ctypes releases the GIL for the call: HTTP and transfer threads run while a kernel does.
Without a C compiler, or with SPECPD_C_KERNELS=0, `load` returns None and callers use torch.
"""
from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import shutil
import subprocess
import tempfile

import torch  # before any kernel loads: the kernels share torch's libgomp (its OpenMP pool)

from specpd.machine import cache_root, cpu_flags, isa

FLAGS = ("-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-fno-math-errno", "-fno-trapping-math")


def flags() -> tuple[str, ...]:
    """FLAGS, plus full-width vectors where the CPU has AVX-512 (gcc prefers 256-bit ones on recent Intel).
    SPECPD_KERNEL_MARCH=x86-64-v3 (say) builds for that target instead of this CPU: the tests build the AVX2
    variant on an AVX-512 box that way."""
    march = os.environ.get("SPECPD_KERNEL_MARCH")
    if march:
        return tuple(f"-march={march}" if f == "-march=native" else f for f in FLAGS)
    return FLAGS + (("-mprefer-vector-width=512",) if "avx512f" in cpu_flags() else ())


def cache_dir() -> str:
    return os.path.join(cache_root(), "kernels")


DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}  # csrc/dtypes.h's codes
VOID_P, INT64 = ctypes.c_void_p, ctypes.c_int64


def source_path(name: str) -> str:
    return os.path.join(os.path.dirname(os.path.abspath(__file__)), "csrc", name)


@functools.cache
def load(filename: str) -> ctypes.CDLL | None:
    """csrc/`filename` compiled for this CPU (cached), or None where it cannot be built."""
    if os.environ.get("SPECPD_C_KERNELS", "1") == "0":
        return None
    cc = shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc")
    if cc is None:
        return None
    with open(source_path(filename), encoding="utf-8") as f:
        source = f.read()
    csrc = os.path.dirname(source_path(filename))
    # every other source in csrc/ too: a kernel may include another's .c (cpu_stack.c does)
    headers = [open(os.path.join(csrc, h), encoding="utf-8").read() for h in sorted(os.listdir(csrc))
               if h.endswith((".h", ".c")) and h != filename]
    key = "\n".join([source, *headers, " ".join(flags()), " ".join(sorted(cpu_flags())), cc])
    stem = os.path.splitext(filename)[0]
    path = os.path.join(cache_dir(), f"{stem}-{hashlib.sha256(key.encode()).hexdigest()[:16]}.so")
    if not os.path.isfile(path):
        try:
            os.makedirs(cache_dir(), exist_ok=True)
            with tempfile.TemporaryDirectory(dir=cache_dir()) as tmp:
                src, out = os.path.join(tmp, filename), os.path.join(tmp, stem + ".so")
                with open(src, "w", encoding="utf-8") as f:
                    f.write(source)
                subprocess.run([cc, *flags(), "-I", csrc, "-o", out, src], check=True, capture_output=True, timeout=300)
                os.replace(out, path)  # atomic: concurrent builders see the whole file or none
        except (OSError, subprocess.SubprocessError):
            return None
    return switch_paths(ctypes.CDLL(path))


def switch_paths(lib: ctypes.CDLL) -> ctypes.CDLL:
    """Switch a kernel library's bf16 paths as this process wants them (one choice per process, whichever library
    computes): `lib.amx` (the GEMM on AMX tiles), `lib.attention_amx` (bf16 attention on AMX tiles) and
    `lib.attention_dp` (bf16 attention on vdpbf16ps pair dots) say which are used."""
    lib.amx = _switch(lib, "specpd_gemm_bf16_use_amx", gemm_amx_wanted())
    lib.attention_amx = _switch(lib, "specpd_attention_use_amx", attention_amx_wanted())
    lib.attention_dp = _switch(lib, "specpd_attention_use_dp", attention_dp_wanted())
    return lib


def _switch(lib: ctypes.CDLL, setter: str, wanted: bool) -> bool:
    """Switch one of a library's bf16 paths (where it has one): whether it is used, False where Linux refused the
    AMX tile state."""
    fn = getattr(lib, setter, None)
    if fn is None:
        return False
    fn.argtypes = [ctypes.c_int]
    return bool(fn(int(wanted)))


def gemm_amx_wanted() -> bool:
    """Every library holding the bf16 GEMM (cpu_gemm_bf16.c, and cpu_stack.c which includes it) multiplies on AMX
    tiles where the CPU has them, unless SPECPD_GEMM_AMX=0 (its vdpbf16ps path then; benchmarks A/B it that
    way): one choice per process, so a weight rounds alike whichever library multiplies it."""
    return os.environ.get("SPECPD_GEMM_AMX", "1") != "0" and isa() == "amx"


def attention_amx_wanted() -> bool:
    """Every library holding the CPU attention (cpu_attention.c, and cpu_stack.c which includes it) runs bf16
    scores and P.V on AMX tiles where the CPU has them, unless SPECPD_ATTENTION_AMX=0: one choice per process, so
    a decode step and a verify row round alike whichever library attends."""
    return os.environ.get("SPECPD_ATTENTION_AMX", "1") != "0" and isa() == "amx"


def attention_dp_wanted() -> bool:
    """Every library holding the CPU attention attends a bf16 pool on vdpbf16ps pair dot products where the CPU has
    AVX512-BF16 but no AMX, unless SPECPD_ATTENTION_DP=0 (the fp32 vector path then): the AMX path's rounding (Q and
    P in bf16, sums in fp32) at half the vector path's multiply-adds. One choice per process (attention_amx_wanted)."""
    return os.environ.get("SPECPD_ATTENTION_DP", "1") != "0" and isa() == "avx512_bf16"
