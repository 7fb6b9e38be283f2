"""The --against side of the kernel benchmarks (evals/kernels_attention.py, kernels_gemm_kernel.py): a kernel's C
source as it was at an earlier commit, compiled as the engine's kernels are.
"""
from __future__ import annotations

import os
import subprocess

from evals.harness.results import REPO_ROOT


def kernel_at(revision: str, filename: str, tmp: str):
    """specpd/kernels/csrc/`filename` as it was at git `revision`, compiled in `tmp` with the flags the engine's
    kernels get here and its paths switched as the engine's are (specpd.kernels.build): the --against side of the
    kernel benchmarks. Its functions are untyped (the caller gives them the current library's argtypes)."""
    import ctypes
    from specpd.kernels import build
    source = subprocess.run(["git", "show", f"{revision}:specpd/kernels/csrc/{filename}"], cwd=REPO_ROOT,
                            capture_output=True, text=True, check=True).stdout
    path, lib = os.path.join(tmp, filename), os.path.join(tmp, filename.replace(".c", "_against.so"))
    with open(path, "w", encoding="utf-8") as f:
        f.write(source)
    subprocess.run(["gcc", *build.flags(), "-I", build.source_path(""), "-o", lib, path], check=True)
    return build.switch_paths(ctypes.CDLL(lib))
