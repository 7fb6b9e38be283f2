"""Compile a kernel's C source once per machine and load it with ctypes (no torch headers, ~1 s with gcc).

The library is built with `-O3 -march=native` (so it uses the CPU's widest vectors: AVX-512 / AMX boxes,
AVX2 ones) and OpenMP; it lands in $SPECPD_CACHE/kernels/ under a name keyed by the source, the flags and
this CPU's feature flags, so a cache directory shared by two machines never hands one the other's code.
OpenMP: the library links libgomp by its soname, which torch has already loaded from its own lib/ (import
torch first), so the kernels and torch share one thread pool and torch.set_num_threads governs both.
ctypes releases the GIL for the call: HTTP and transfer threads run while a kernel does.
Without a C compiler, or with SPECPD_C_KERNELS=0, `load` returns None and callers use torch. So does a build that
fails (a compiler too old for the CPU's intrinsics, a source missing from an install): it is logged once per
library, as a warning with the command and the compiler's message, and `unavailable(filename)` says why to a
caller that reports what it runs instead. Each caller asks when its backend or model is built, never in a step.
"""
from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile

import torch  # before any kernel loads: the kernels share torch's libgomp (its OpenMP pool)

from specpd.machine import cache_root, cpu_flags, isa

logger = logging.getLogger(__name__)

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


_FAILED: dict[str, str] = {}  # filename -> why its library is not loaded, in a line (load's warning has it all)


def compiler() -> str | None:
    """The C compiler the kernels are built with: $CC (default cc), else gcc; None where neither is on PATH."""
    return shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc")


def unavailable(filename: str) -> str | None:
    """Why `load(filename)` returned None, in a line (its warning has the command and the whole message), or
    None: it loaded, or was not asked yet."""
    return _FAILED.get(filename)


@functools.cache
def load(filename: str) -> ctypes.CDLL | None:
    """csrc/`filename` compiled for this CPU (cached), or None where it cannot be built (logged once, why kept
    for `unavailable`)."""
    if os.environ.get("SPECPD_C_KERNELS", "1") == "0":
        _FAILED[filename] = "SPECPD_C_KERNELS=0"
        return None
    cc = compiler()
    if cc is None:
        _FAILED[filename] = f"no C compiler ({os.environ.get('CC', 'cc')} or gcc) on PATH"
        _warn_no_compiler(_FAILED[filename])
        return None
    csrc = os.path.dirname(source_path(filename))
    try:
        with open(source_path(filename), encoding="utf-8") as f:
            source = f.read()
        # every other source in csrc/ too: a kernel may include another's .c (cpu_stack.c does)
        headers = []
        for name in sorted(os.listdir(csrc)):
            if name.endswith((".h", ".c")) and name != filename:
                with open(os.path.join(csrc, name), encoding="utf-8") as f:
                    headers.append(f.read())
    except OSError as err:  # an install that left csrc/ out, or part of it
        return _fail(filename, f"cannot read its sources: {err}")
    key = "\n".join([source, *headers, " ".join(flags()), " ".join(sorted(cpu_flags())), cc])
    stem = os.path.splitext(filename)[0]
    path = os.path.join(cache_dir(), f"{stem}-{hashlib.sha256(key.encode()).hexdigest()[:16]}.so")
    if not os.path.isfile(path):
        failed = _compile(cc, filename, source, csrc, path)
        if failed is not None:
            return _fail(filename, *failed)
    try:
        return switch_paths(ctypes.CDLL(path))
    except OSError as err:  # a damaged or foreign file in the cache
        return _fail(filename, f"cannot load {path}: {err}")


def _compile(cc: str, filename: str, source: str, csrc: str, path: str) -> tuple[str, str] | None:
    """Build the library at `path`; None, or why it failed: (the compiler's first error line, the command and
    its whole message)."""
    stem = os.path.splitext(filename)[0]
    cmd = [cc, *flags(), "-I", csrc, "-o", stem + ".so", filename]
    try:
        os.makedirs(cache_dir(), exist_ok=True)
        with tempfile.TemporaryDirectory(dir=cache_dir()) as tmp:
            with open(os.path.join(tmp, filename), "w", encoding="utf-8") as f:
                f.write(source)
            proc = subprocess.run(cmd, cwd=tmp, capture_output=True, text=True, timeout=300)
            if proc.returncode != 0:
                lines = (proc.stderr or proc.stdout).strip().splitlines() or ["(no message)"]
                first = next((line for line in lines if "error" in line), lines[0])
                return (f"the compiler failed: {first}",
                        f"`{' '.join(cmd)}` exited with {proc.returncode}:\n" + "\n".join(lines)[:4000])
            os.replace(os.path.join(tmp, stem + ".so"), path)  # atomic: concurrent builders see the file or none
    except (OSError, subprocess.SubprocessError) as err:
        return f"the compiler did not run: {err}", f"`{' '.join(cmd)}` did not run: {err}"
    return None


def _fail(filename: str, why: str, details: str | None = None) -> None:
    _FAILED[filename] = why
    logger.warning("C kernel %s not built (its callers take their torch path): %s", filename, details or why)
    return None


@functools.cache
def _warn_no_compiler(why: str) -> None:
    """Once a process, not once a library: every kernel is off for the one reason."""
    logger.warning("C kernels not built (their callers take their torch paths): %s", why)


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
