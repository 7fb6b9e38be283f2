"""What a verify row costs on the quantized kernel, against the int8 dot-product peak of this CPU.

A b1 decode step on the default GGUF streams its 96 MB of blocks, so one row costs the read; every further
row of a verify tree reuses the weight tile already in registers (csrc/cpu_gemm_q.c) and costs compute alone:
the model's weights x 1 row of int8 multiply-adds. This measures, interleaved at the engine's thread count:
  1. one forward's linears (30 layers + the LM head, the default GGUF's formats) over 1..16 rows on the kernel,
     and the marginal milliseconds per row past the first (least squares over 2..16 rows);
  2. the peak rate of the instruction the kernel's dot products run on (AVX512-VNNI `vpdpbusd` on 16
     independent accumulators, every thread), from a probe compiled here with the kernels' compiler, run in every
     repetition beside the timings (a shared box's rate moves from minute to minute);
  3. the floor per row that rate sets: weights / (64 multiply-adds an instruction) / the rate.
Where the marginal row sits at that floor, the kernel cannot make a row cheaper: only fewer rows (a narrower tree)
or more accepted tokens per row (a better draft) lower a round's cost. AVX512-VNNI boxes only (an AVX2 box runs
vpmaddubsw, which the probe does not time; it records that and skips 2 and 3).

    python -m evals.kernels_q_rows            -> evals/results/kernels_q_rows.json
"""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import tempfile

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import torch

from evals.harness.results import REPO_ROOT, log, machine_info, versions, write_json
from evals.kernels_gemm import interleaved_times
from evals.kernels_gemm_q import GGUF_FORMATS, weights
from specpd.kernels import cpu_gemm_q as gq
from specpd.kernels.build import compiler, flags
from specpd.machine import isa, usable_cores

OUT = os.path.join(REPO_ROOT, "evals", "results", "kernels_q_rows.json")
ROWS = (1, 2, 3, 4, 6, 8, 12, 16)
MACS_PER_INSTRUCTION = 64  # vpdpbusd on 512 bits: 16 lanes x 4 byte products

PROBE = r"""
#include <immintrin.h>
#include <stdio.h>
#include <omp.h>
int main(int argc, char** argv) {
  const long iters = 100000000;
  double t0 = omp_get_wtime();
  int sink = 0;
  #pragma omp parallel reduction(+:sink)
  {
    __m512i a[16];
    for (int i = 0; i < 16; i++) a[i] = _mm512_set1_epi32(i);
    __m512i w = _mm512_set1_epi8(3), x = _mm512_set1_epi8(5);
    for (long it = 0; it < iters / 16; it++) {
#pragma GCC unroll 16
      for (int i = 0; i < 16; i++) a[i] = _mm512_dpbusd_epi32(a[i], w, x);
      __asm__ volatile("" : "+v"(w), "+v"(x));
    }
    for (int i = 0; i < 16; i++) sink += _mm512_reduce_add_epi32(a[i]);
  }
  double dt = omp_get_wtime() - t0;
  printf("%.6e %d\n", omp_get_max_threads() * (double)iters / dt, sink & 1);
  return 0;
}
"""


def build_probe(tmp: str) -> str | None:
    """The probe's executable in `tmp`, or None where it cannot be built or run (no compiler, no AVX512-VNNI)."""
    cc = compiler()
    if cc is None or isa() not in ("amx", "avx512_bf16", "avx512_vnni"):
        return None
    src, exe = os.path.join(tmp, "probe.c"), os.path.join(tmp, "probe")
    with open(src, "w") as f:
        f.write(PROBE)
    build = [f for f in flags() if f not in ("-shared", "-fPIC")]
    return None if subprocess.run([cc, *build, "-O2", "-o", exe, src], capture_output=True).returncode else exe


def vnni_rate(exe: str, threads: int) -> float:
    """vpdpbusd instructions per second over `threads` threads, one run of the probe."""
    env = dict(os.environ, OMP_NUM_THREADS=str(threads))
    return float(subprocess.run([exe], env=env, capture_output=True, text=True, check=True).stdout.split()[0])


def marginal_ms(ms: dict[int, float]) -> float:
    """Least-squares slope of ms over rows 2.. (the first row also pays the read)."""
    xs = [r for r in ms if r > 1]
    mx, my = statistics.mean(xs), statistics.mean(ms[r] for r in xs)
    return sum((r - mx) * (ms[r] - my) for r in xs) / sum((r - mx) ** 2 for r in xs)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--reps", type=int, default=9)
    ap.add_argument("--out", default=OUT)
    args = ap.parse_args()
    threads = usable_cores()
    torch.set_num_threads(threads)
    ws = weights()
    layers = [(f, gq.pack(f, gq.quantize(f, w), w.shape[1]), w.shape[0], w.shape[1]) for f, w in zip(GGUF_FORMATS, ws)]
    n_weights = sum(w.numel() for w in ws)
    gen = torch.Generator().manual_seed(0)
    xs = {(m, k): torch.randn(m, k, generator=gen).bfloat16() for m in ROWS for k in {w.shape[1] for w in ws}}
    fns = {m: (lambda m=m: [gq.gemm(xs[(m, k)], f, p, None, n) for f, p, n, k in layers]) for m in ROWS}
    log(f"{threads} threads, rows {ROWS}, {args.reps} interleaved reps, the probe run in each")
    rates = []
    with tempfile.TemporaryDirectory() as tmp:
        exe = build_probe(tmp)
        # the box drifts: every repetition times each row count and then the probe
        probe = (lambda: rates.append(vnni_rate(exe, threads))) if exe else None
        times = interleaved_times(fns, args.reps, between=probe)
    ms = {m: 1000 * statistics.median(v) for m, v in times.items()}
    slope = marginal_ms(ms)
    result = {"rows": {str(m): {"ms": round(ms[m], 3), "ms_range": [round(1000 * min(v), 3), round(1000 * max(v), 3)],
                                "over_1_row": round(ms[m] / ms[1], 3)} for m, v in times.items()},
              "marginal_ms_per_row": round(slope, 4), "weights": n_weights}
    if rates:
        rate = statistics.median(rates)
        floor = n_weights / MACS_PER_INSTRUCTION / rate * 1000
        result.update({"vpdpbusd_per_s": rate, "vpdpbusd_per_s_range": [min(rates), max(rates)],
                       "int8_macs_per_s": rate * MACS_PER_INSTRUCTION, "floor_ms_per_row": round(floor, 4),
                       "marginal_over_floor": round(slope / floor, 3)})
    log(f"marginal {slope:.3f} ms a row" + (f", VNNI floor {result['floor_ms_per_row']:.3f}" if rates else ""))
    write_json(args.out, {"description": __doc__.split("\n")[0], "command": "python -m evals.kernels_q_rows",
                          "meta": {"machine": machine_info(), "isa": isa(), "q_kernel_path": gq.path(),
                                   "threads": threads, "reps": args.reps, "format": "the default GGUF's (Q4_1 "
                                   "linears, Q8_0 head), bf16 activations", "versions": versions()},
                          **result})


if __name__ == "__main__":
    main()
