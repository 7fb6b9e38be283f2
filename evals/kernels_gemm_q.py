"""Quantized-weight GEMM paths for the default model's linears on this CPU, by thread count and row count.

One "step" = every linear of one forward of SmolLM2-135M (30 layers x qkv, o, gate/up, down) plus the LM head,
over M rows (1 = decode at batch 1; 2..32 = verify trees and batched decode; 128, 512 = prefill chunks). Paths:
  - specpd's quantized kernel (specpd/kernels/cpu_gemm_q.py) on the formats as the default GGUF holds them (Q4_1
    layers, Q8_0 head), fp32 activations, this CPU's build and its AVX2 build (x86-64-v3, vpmaddubsw: what an
    AVX2-only box runs), and with every weight in Q4_0 or Q8_0;
  - torch's weight-only CPU ops as specpd/model/quant.py used them (`aten._weight_int4pack_mm_for_cpu`, groups of
    32, and `aten._weight_int8pack_mm`, per channel; bf16 activations, their vectorized path; int8 head);
  - the dense paths on the dequantized weights: specpd's fp32 kernel (AVX-512) and bf16 kernel (AVX512-BF16),
    and oneDNN's prepacked fp32 linear (what AVX2 boxes serve fp32 with);
  - the floors: each weight set's bytes over the read bandwidth measured on the box (evals/engine_step.py's
    ReadProbe).
The paths are timed interleaved in every repetition (the box drifts); each figure is a median.

    .venv/bin/python -m evals.kernels_gemm_q            -> evals/results/kernels_gemm_q.json
"""
from __future__ import annotations

import argparse
import os
import statistics

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import torch

from evals.harness.results import REPO_ROOT, log, machine_info, versions, write_json
from evals.engine_step import ReadProbe
from evals.kernels_gemm import interleaved_times
from specpd.kernels import cpu_gemm_bf16, cpu_gemm_f32
from specpd.kernels import cpu_gemm_q as gq
from specpd.machine import isa, usable_cores

OUT = os.path.join(REPO_ROOT, "evals", "results", "kernels_gemm_q.json")
# SmolLM2-135M: hidden 576, intermediate 1536, 9 q / 3 kv heads of 64, vocab 49152, 30 layers
LAYER = [(960, 576), (576, 576), (3072, 576), (576, 1536)]
HEAD = (49152, 576)
LAYERS = 30
GGUF_FORMATS = ["Q4_1"] * (LAYERS * len(LAYER)) + ["Q8_0"]  # the default GGUF's linears, then its tied head


def weights() -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    ws = [torch.randn(o, i, generator=gen) * 0.02 for _ in range(LAYERS) for o, i in LAYER]
    ws.append(torch.randn(*HEAD, generator=gen) * 0.02)
    return ws


class Paths:
    """Every path's weights, prepared once; `step(m)` gives each path's one-step callable over m rows."""

    def __init__(self, ws: list[torch.Tensor]):
        self.ws = ws
        self.quant = {}  # name -> [(format, packed, n)]
        sets = {"gguf (Q4_1 + Q8_0 head)": GGUF_FORMATS, "all Q4_0": ["Q4_0"] * len(ws), "all Q8_0": ["Q8_0"] * len(ws)}
        dense = []
        for name, formats in sets.items():
            blocks = [gq.quantize(f, w) for f, w in zip(formats, ws)]
            self.quant[name] = [(f, gq.pack(f, b, w.shape[1]), w.shape[0]) for f, b, w in zip(formats, blocks, ws)]
            if name.startswith("gguf"):
                dense = [gq.dequantize(f, b, w.shape[1]) for f, b, w in zip(formats, blocks, ws)]
        self.avx2 = gq.variant("x86-64-v3")
        self.dense = dense  # the GGUF's weights dequantized, fp32
        self.bytes = {name: sum(p.numel() for _, p, _ in qs) for name, qs in self.quant.items()}
        self.bytes["fp32"] = sum(w.numel() * 4 for w in dense)
        self.bytes["bf16"] = self.bytes["fp32"] // 2
        self.f32 = [cpu_gemm_f32.pack(w) for w in dense] if cpu_gemm_f32.available() else None
        self.bf16 = [cpu_gemm_bf16.pack(w.bfloat16()) for w in dense] if cpu_gemm_bf16.available() else None
        self.onednn = [torch.ops.mkldnn._reorder_linear_weight(w, 16) for w in dense]
        self.torch_q = self._torch_quant(dense)

    @staticmethod
    def _torch_quant(dense: list[torch.Tensor]) -> dict:
        """specpd's former torch-op layers (git history of specpd/model/quant.py): int4 in groups of 32 with an
        int8 head, and per-channel int8; bf16 scales and activations."""
        int8 = [torch_int8(w) for w in dense]
        return {"torch int4 (int8 head), bf16 x": [torch_int4(w) for w in dense[:-1]] + int8[-1:],
                "torch int8, bf16 x": int8}

    def step(self, m: int) -> dict:
        gen = torch.Generator().manual_seed(m)
        xs = {k: torch.randn(m, k, generator=gen) for k in {w.shape[1] for w in self.ws}}
        xb = {k: x.bfloat16() for k, x in xs.items()}
        ks = [w.shape[1] for w in self.ws]
        out = {}
        for name, qs in self.quant.items():
            out[f"specpd q {name}"] = lambda qs=qs: [gq.gemm(xs[k], f, p, None, n) for k, (f, p, n) in zip(ks, qs)]
        gguf = self.quant["gguf (Q4_1 + Q8_0 head)"]
        if self.avx2 is not None:
            out["specpd q gguf, AVX2 build"] = lambda: [gq.gemm(xs[k], f, p, None, n, self.avx2)
                                                        for k, (f, p, n) in zip(ks, gguf)]
        for name, layers in self.torch_q.items():
            out[name] = lambda layers=layers: [fn(xb[k]) for k, fn in zip(ks, layers)]
        ns = [w.shape[0] for w in self.ws]
        if self.f32 is not None:
            out["specpd fp32 kernel"] = lambda: [cpu_gemm_f32.gemm(xs[k], w, None, n)
                                                 for k, n, w in zip(ks, ns, self.f32)]
        if self.bf16 is not None:
            out["specpd bf16 kernel"] = lambda: [cpu_gemm_bf16.gemm(xb[k], w, None, n)
                                                 for k, n, w in zip(ks, ns, self.bf16)]
        out["onednn fp32 packed"] = lambda: [torch.ops.mkldnn._linear_pointwise(xs[k], w, None, "none", [], "")
                                             for k, w in zip(ks, self.onednn)]
        return out


def torch_int4(weight: torch.Tensor):
    """x -> x @ W.T through `aten._weight_int4pack_mm_for_cpu`: groups of 32 input columns, asymmetric
    (w = (q - 8) * scale + zero), bf16 scale / zero."""
    n, k = weight.shape
    w = weight.view(n, k // 32, 32)
    low, high = w.amin(-1), w.amax(-1)
    scale = (high - low) / 15
    inv = torch.where(scale > 0, 1 / scale, torch.zeros_like(scale))
    codes = ((w - low.unsqueeze(-1)) * inv.unsqueeze(-1)).round_().clamp_(0, 15).view(n, k)
    scale_zeros = torch.stack([scale, low + 8 * scale], dim=-1).transpose(0, 1).bfloat16().contiguous()
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes.int(), 1)
    return lambda x: torch.ops.aten._weight_int4pack_mm_for_cpu(x, packed, 32, scale_zeros)


def torch_int8(weight: torch.Tensor):
    """x -> x @ W.T through `aten._weight_int8pack_mm`: per-channel absmax / 127 scales (bf16)."""
    scale = weight.abs().amax(-1) / 127
    codes = (weight / scale.unsqueeze(-1)).round_().clamp_(-127, 127).to(torch.int8)
    scale = scale.bfloat16()
    return lambda x: torch._weight_int8pack_mm(x, codes, scale)


def timed(fns: dict, reps: int) -> tuple[dict, dict]:
    """(median ms, fastest ms) of each path, the paths interleaved in every repetition (on a shared box the
    fastest is the run least disturbed by the neighbours)."""
    times = interleaved_times(fns, reps)
    return ({k: round(1000 * statistics.median(v), 2) for k, v in times.items()},
            {k: round(1000 * min(v), 2) for k, v in times.items()})


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 128, 512])
    ap.add_argument("--threads", type=int, nargs="+", default=sorted({1, min(2, usable_cores())}))
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--out", default=OUT)
    args = ap.parse_args()
    load_start = round(os.getloadavg()[0], 2)
    paths = Paths(weights())
    meta = {"machine": machine_info(), "isa": isa(), "q_kernel_path": gq.path(), "versions": versions(),
            "reps": args.reps, "weight_bytes": paths.bytes,
            "unit": "ms per step (every linear of one SmolLM2-135M forward + LM head): median (ms) and fastest "
                    "(ms_fastest) of the interleaved repetitions"}
    results = []
    for threads in args.threads:
        bandwidth = ReadProbe(threads).median()  # sets the thread count too
        floors = {name: round(1000 * n / bandwidth, 2) for name, n in paths.bytes.items()}
        for m in args.rows:
            ms, fastest = timed(paths.step(m), args.reps if m < 128 else max(3, args.reps // 2))
            row = {"threads": threads, "rows": m, "read_gb_s": round(bandwidth / 1e9, 1), "floor_ms": floors,
                   "load_average_1m": round(os.getloadavg()[0], 2), "ms": ms, "ms_fastest": fastest}
            row["best"] = min(row["ms"], key=row["ms"].get)
            results.append(row)
            log(f"threads={threads}", f"M={m}", row["ms"], "best:", row["best"])
    meta["load_average_1m_start_end"] = [load_start, round(os.getloadavg()[0], 2)]  # the box is shared
    write_json(args.out, {"meta": meta, "results": results})
    log("wrote", args.out)


if __name__ == "__main__":
    main()
