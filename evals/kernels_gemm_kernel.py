"""The few-row GEMM kernel alone, against an earlier version of its source, interleaved.

One "forward" is every linear of SmolLM2-135M's 30 decoder layers (qkv 960 x 576, o 576 x 576, gate/up 3072 x 576,
down 576 x 1536: 212 MB of bf16 weights, more than any cache holds, so every forward reads them from memory) over M
rows: 1 (decode at batch 1), 2..8 (a verify tree at batch 1), 12..64 (batched decode and verify). The kernel in the
working tree (csrc/cpu_gemm_bf16.c, or cpu_gemm_f32.c with `--dtype float32`) runs against `--against REV`'s
source compiled here with the same flags and its paths switched as the engine's, the two alternated pair by pair
(the box drifts); the outputs are compared bit for bit. `read_gb_s`: the weights' bytes over the current kernel's
median time.

    .venv/bin/python -m evals.kernels_gemm_kernel --against 2b84204     → evals/results/kernels_gemm_kernel.json
"""
from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
EVALS_DIR = os.path.dirname(os.path.abspath(__file__))

import torch

from evals.harness.results import REPO_ROOT, command_line, log, machine_info, versions, write_json
from evals.kernels_against import kernel_at
from specpd.kernels import cpu_gemm_bf16, cpu_gemm_f32
from specpd.machine import isa

LAYERS = 30
SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]  # (out, in) of one layer's linears
KERNELS = {"bfloat16": (cpu_gemm_bf16, "cpu_gemm_bf16.c", "specpd_gemm_bf16"),
           "float32": (cpu_gemm_f32, "cpu_gemm_f32.c", "specpd_gemm_f32")}


def forward(fn, weights, xs, outs, m: int) -> None:
    for (packed, n, k), x, out in zip(weights, xs, outs):
        fn(x.data_ptr(), m, k, packed.data_ptr(), None, n, out.data_ptr())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--against", required=True, help="a git revision whose kernel source to compare with")
    ap.add_argument("--dtype", default="bfloat16", choices=sorted(KERNELS))
    ap.add_argument("--rows", default="1,2,4,5,6,7,8,12,16,24,32,64")
    ap.add_argument("--pairs", type=int, default=30, help="alternated pairs of forwards per row count")
    ap.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    ap.add_argument("--out", default=os.path.join(REPO_ROOT, "evals", "results", "kernels_gemm_kernel.json"))
    args = ap.parse_args()
    module, source, entry = KERNELS[args.dtype]
    if not module.available():
        raise SystemExit(f"no {args.dtype} few-row kernel on this CPU ({isa()})")
    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    gen = torch.Generator().manual_seed(0)
    weights = [(module.pack((torch.randn(n, k, generator=gen) * 0.05).to(dtype)), n, k)
               for _ in range(LAYERS) for n, k in SHAPES]
    nbytes = sum(n * k for _, n, k in weights) * torch.finfo(dtype).bits // 8
    current = getattr(module._lib(), entry)
    result = {"benchmark": "gemm_kernel", "command": command_line(), "machine": machine_info(),
              "versions": versions(), "isa": isa(), "args": vars(args), "weight_bytes": nbytes, "rows": {}}
    with tempfile.TemporaryDirectory() as tmp:
        against = getattr(kernel_at(args.against, source, tmp), entry)
        against.argtypes, against.restype = current.argtypes, current.restype
        kernels = {"current": current, "against": against}
        for m in [int(r) for r in args.rows.split(",")]:
            xs = [torch.randn(m, k, generator=gen).to(dtype) for _, _, k in weights]
            outs = {name: [torch.empty(m, n, dtype=dtype) for _, n, _ in weights] for name in kernels}
            for name, fn in kernels.items():  # warm-up, and the outputs compared
                forward(fn, weights, xs, outs[name], m)
            times = {name: [] for name in kernels}
            order = list(kernels)
            for i in range(args.pairs):
                for name in order[i % 2:] + order[:i % 2]:
                    t = time.perf_counter()
                    forward(kernels[name], weights, xs, outs[name], m)
                    times[name].append(time.perf_counter() - t)
            ratios = [a / c for a, c in zip(times["against"], times["current"])]
            quartiles = statistics.quantiles(ratios, n=4)
            cell = {f"{k}_ms": 1e3 * statistics.median(v) for k, v in times.items()}
            cell.update(speedup=statistics.median(ratios), speedup_iqr=[quartiles[0], quartiles[2]],
                        speedup_spread=[min(ratios), max(ratios)],
                        read_gb_s=nbytes / statistics.median(times["current"]) / 1e9,
                        bit_identical=all(torch.equal(a, b) for a, b in zip(outs["current"], outs["against"])))
            result["rows"][str(m)] = cell
            log(f"M={m}: current {cell['current_ms']:.2f} ms, against {cell['against_ms']:.2f} ms, "
                f"x{cell['speedup']:.3f} (IQR {quartiles[0]:.3f}-{quartiles[2]:.3f}), {cell['read_gb_s']:.1f} GB/s, "
                f"bit-identical {cell['bit_identical']}")
    write_json(args.out, result)
    log(f"wrote {args.out}")


if __name__ == "__main__":
    main()
