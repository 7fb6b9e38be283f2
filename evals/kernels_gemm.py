"""GEMM paths for the default model's linear layers on this CPU, by dtype, thread count and row count.

One "step" = every linear of one forward of SmolLM2-135M (30 layers x qkv, o, gate/up, down) plus the LM head,
over M rows (1 = decode at batch 1; 2..64 = verify trees and batched decode). Paths, all on the same weights:
  - F.linear over the [out, in] weight (torch's default; MKL sgemm / oneDNN bf16, packing per call),
  - x @ W_t over an [in, out] copy (MKL's gemv at one row),
  - oneDNN prepacked (`mkldnn._linear_pointwise` on a weight reordered once; what specpd/kernels/cpu_linear.py
    serves with),
  - MKL prepacked for that exact M (`mkl._mkl_linear`, fp32; what inductor's freezing uses),
  - specpd's few-row bf16 kernel (specpd/kernels/cpu_gemm_bf16.py, AVX512-BF16 / AMX CPUs: what cpu_linear.py
    serves GEMMs of up to `max_rows()` rows with), and the floor: the weights' bytes over the read bandwidth
    measured on the box (evals/engine_step.py's `ReadProbe`).
  - specpd's fp32 kernel (specpd/kernels/cpu_gemm_f32.py, AVX-512 CPUs: the bf16 kernel's layout and tiles with
    FMAs, what cpu_linear.py serves every fp32 GEMM with there). (An earlier few-row fp32 kernel, cpu_gemm, lost
    to the prepacked paths on an AMX box and was removed; git history has it.)
The paths are timed interleaved in every repetition (the box drifts); each figure is a median.

    .venv/bin/python -m evals.kernels_gemm            → evals/results/kernels_gemm.json
"""
from __future__ import annotations

import argparse
import os
import statistics
import time

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import torch
import torch.nn.functional as F

from evals.harness.results import REPO_ROOT, log, machine_info, versions, write_json
from evals.engine_step import ReadProbe
from specpd.kernels import cpu_gemm_bf16, cpu_gemm_f32
from specpd.machine import isa, usable_cores

OUT = os.path.join(REPO_ROOT, "evals", "results", "kernels_gemm.json")
# SmolLM2-135M: hidden 576, intermediate 1536, 9 q / 3 kv heads of 64, vocab 49152, 30 layers
LAYER = [(960, 576), (576, 576), (3072, 576), (576, 1536)]
HEAD = (49152, 576)
LAYERS = 30


def weights(dtype: torch.dtype) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    ws = [torch.randn(o, i, generator=gen) * 0.02 for _ in range(LAYERS) for o, i in LAYER]
    ws.append(torch.randn(*HEAD, generator=gen) * 0.02)
    return [w.to(dtype) for w in ws]


def paths(ws: list[torch.Tensor], m: int, dtype: torch.dtype, threads: int) -> dict:
    xs = {i: torch.randn(m, i).to(dtype) for i in {w.shape[1] for w in ws}}
    out = {"F.linear": lambda: [F.linear(xs[w.shape[1]], w) for w in ws]}
    wts = [w.t().contiguous() for w in ws]
    out["x@W_t"] = lambda: [xs[w.shape[0]] @ w for w in wts]
    packed = [torch.ops.mkldnn._reorder_linear_weight(w, 16) for w in ws]
    out["onednn packed"] = lambda: [torch.ops.mkldnn._linear_pointwise(xs[w.shape[1]], p, None, "none", [], "")
                                    for w, p in zip(ws, packed)]
    if dtype == torch.float32:
        mkl = [torch.ops.mkl._mkl_reorder_linear_weight(w, m) for w in ws]
        out["mkl packed (per M)"] = lambda: [torch.ops.mkl._mkl_linear(xs[w.shape[1]], p, w, None, m)
                                             for w, p in zip(ws, mkl)]
    kernels = {torch.bfloat16: (cpu_gemm_bf16, "bf16"), torch.float32: (cpu_gemm_f32, "fp32")}
    kernel, name = kernels.get(dtype, (None, ""))
    if kernel is not None and kernel.available():
        few = [kernel.pack(w) for w in ws]
        out[f"specpd {name} kernel"] = lambda: [kernel.gemm(xs[w.shape[1]], p, None, w.shape[0])
                                                for w, p in zip(ws, few)]
    return out


def interleaved_times(fns: dict, reps: int, between=None) -> dict[str, list[float]]:
    """Seconds of each call, every path once per repetition (after one warm-up call each); `between`, when given,
    is called after each repetition (a probe read beside the timings)."""
    for fn in fns.values():
        fn()
    times = {k: [] for k in fns}
    for _ in range(reps):
        for k, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            times[k].append(time.perf_counter() - t0)
        if between is not None:
            between()
    return times


def timed(fns: dict, reps: int) -> dict:
    return {k: round(1000 * statistics.median(v), 2) for k, v in interleaved_times(fns, reps).items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 64, 128, 512])
    ap.add_argument("--threads", type=int, nargs="+", default=sorted({1, usable_cores()}))
    ap.add_argument("--dtypes", nargs="+", default=["bfloat16", "float32"])
    ap.add_argument("--reps", type=int, default=9)
    ap.add_argument("--out", default=OUT)
    args = ap.parse_args()
    meta = {"machine": machine_info(), "isa": isa(), "versions": versions(), "reps": args.reps,
            "unit": "ms per step (every linear of one SmolLM2-135M forward + LM head), median"}
    results = []
    for dtype_name in args.dtypes:
        dtype = getattr(torch, dtype_name)
        ws = weights(dtype)
        nbytes = sum(w.numel() * w.element_size() for w in ws)
        for threads in args.threads:
            floor_ms = round(1000 * nbytes / ReadProbe(threads).median(), 2)  # sets the thread count too
            for m in args.rows:
                row = {"dtype": dtype_name, "threads": threads, "rows": m, "floor_ms": floor_ms,
                       "ms": timed(paths(ws, m, dtype, threads), args.reps)}
                row["best"] = min(row["ms"], key=row["ms"].get)
                results.append(row)
                log(dtype_name, f"threads={threads}", f"M={m}", row["ms"], "best:", row["best"])
    write_json(args.out, {"meta": meta, "results": results})
    log("wrote", args.out)


if __name__ == "__main__":
    main()
