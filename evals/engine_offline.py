"""Offline throughput: specpd vs HF transformers `generate` on the same weights (the default model,
SmolLM2-135M-Instruct), greedy, EOS ignored, prompts of exactly --prompt-len tokens of ShareGPT text.

Configs: each engine at each --dtypes entry (dense weights: the GGUF dequantized), plus specpd with
weight-only quantization (--quantizations, bfloat16 activations only: `bfloat16+int4` reproduces the
GGUF's Q4_1 codes, see specpd/model/quant.py). HF runs dense only.

Every config runs in this one process and the configs are interleaved rep by rep, in a rotating
order (the machine is shared and noisy); medians over reps are reported.
  tok/s (end-to-end, prefill included) = N * out / t_total
  TTFT    = time until every request of the batch has its first token (batch 1: the usual TTFT)
  decode tok/s (prefill excluded) = N * (out - 1) / (t_total - TTFT)

  python -m evals.engine_offline --threads 1   # full run -> evals/results/engine_offline.json
  python -m evals.engine_offline --quick       # smoke run (short prompts, 1 rep) -> $TMPDIR, not results/
"""
from __future__ import annotations

import argparse
import os
import tempfile
import time

import torch

EVALS_DIR = os.path.dirname(os.path.abspath(__file__))
from evals.harness.prompts import real_text_prompts
from evals.harness.results import log, machine_info, median, versions, write_json

from specpd.config import CacheConfig, EngineConfig
from specpd.core import SamplingParams
from specpd.engine.llm_engine import LLMEngine
from specpd.model.loader import load_checkpoint

RESULTS_DIR = os.path.join(EVALS_DIR, "results")
TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
QUANT_DTYPE = "bfloat16"  # the only activation dtype specpd's quantized linears run with


def label(dtype: str, quantization: str = "none") -> str:
    """A config's name in results and ratio keys: `float32`, `bfloat16`, `bfloat16+int4`."""
    return dtype if quantization == "none" else f"{dtype}+{quantization}"


class SpecpdRunner:
    engine_name = "specpd"

    def __init__(self, ckpt, dtype: str, max_batch: int, max_len: int, quantization: str = "none",
                 num_threads: int | None = None, page_size: int = 16):
        pages = max_batch * -(-max_len // page_size) + 8
        self.config = EngineConfig(model="default", dtype=dtype, quantization=quantization, num_threads=num_threads,
                                   cache=CacheConfig(page_size=page_size, num_pages=pages))
        self.engine = LLMEngine(self.config, checkpoint=ckpt)
        self._runs = 0

    def run(self, prompts: list[list[int]], output_len: int) -> tuple[float, float, list[list[int]]]:
        """-> (t_total, t_every_first_token, output ids per prompt); times from before the first add."""
        params = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
        self._runs += 1
        ids = [f"bench-{self._runs}-{i}" for i in range(len(prompts))]
        done: dict[str, list[int]] = {}
        started: set[str] = set()
        t_first = None
        t0 = time.perf_counter()
        for rid, prompt in zip(ids, prompts):
            self.engine.add_request(rid, prompt, params)
        while self.engine.has_unfinished_requests():
            outs = self.engine.step()
            started.update(o.request_id for o in outs if o.new_token_ids)
            if t_first is None and len(started) == len(ids):
                t_first = time.perf_counter() - t0
            done.update((o.request_id, o.token_ids) for o in outs if o.finished)
        return time.perf_counter() - t0, t_first, [done[r] for r in ids]


class _FirstTokenClock:
    """HF streamer protocol: the first put() is the prompts, the second the first new token of every row."""

    def __init__(self, t0: float):
        self.t0, self.puts, self.t_first = t0, 0, None

    def put(self, value):
        self.puts += 1
        if self.puts == 2:
            self.t_first = time.perf_counter() - self.t0

    def end(self):
        pass


class HFRunner:
    engine_name = "hf"

    def __init__(self, ckpt, dtype: str):
        from transformers import LlamaConfig, LlamaForCausalLM
        cfg = LlamaConfig(**{k: v for k, v in ckpt.hf_config.items() if k != "model_type"})
        model = LlamaForCausalLM(cfg).eval()
        missing, unexpected = model.load_state_dict(ckpt.weights, strict=False)
        if unexpected or [m for m in missing if m != "lm_head.weight"]:  # lm_head is tied to the embedding
            raise RuntimeError(f"HF load: missing {missing}, unexpected {unexpected}")
        model.generation_config.eos_token_id = None
        self.model = model.to(TORCH_DTYPES[dtype])
        self.attn_implementation = model.config._attn_implementation

    @torch.inference_mode()
    def run(self, prompts: list[list[int]], output_len: int) -> tuple[float, float, list[list[int]]]:
        input_ids = torch.tensor(prompts)  # equal lengths: no padding
        t0 = time.perf_counter()
        clock = _FirstTokenClock(t0)
        out = self.model.generate(input_ids, attention_mask=torch.ones_like(input_ids), max_new_tokens=output_len,
                                  min_new_tokens=output_len, do_sample=False, pad_token_id=0, streamer=clock)
        t_total = time.perf_counter() - t0
        return t_total, clock.t_first, out[:, input_ids.shape[1]:].tolist()


def measure(runner, prompts, output_len: int) -> dict:
    load = os.getloadavg()[0]  # > usable cores while measuring means other jobs shared the CPU
    t_total, t_first, outputs = runner.run(prompts, output_len)
    n_out = sum(len(o) for o in outputs)
    if n_out != len(prompts) * output_len:
        raise RuntimeError(f"{runner.engine_name}: {n_out} output tokens, expected {len(prompts) * output_len}")
    return {"loadavg_1m": load, "t_total_s": t_total, "tokens_per_s": n_out / t_total, "ttft_s": t_first,
            "decode_tokens_per_s": len(prompts) * (output_len - 1) / (t_total - t_first), "outputs": outputs}


def common_prefix(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"], choices=list(TORCH_DTYPES))
    ap.add_argument("--quantizations", nargs="*", default=["int4"], choices=["int4", "int8"],
                    help=f"extra specpd configs with quantized weights ({QUANT_DTYPE} activations)")
    ap.add_argument("--engines", nargs="+", default=["specpd", "hf"], choices=["specpd", "hf"])
    ap.add_argument("--threads", type=int, default=None,
                    help="torch.set_num_threads (default: torch's own, = usable cores). On a shared machine "
                         "2 OpenMP threads on 2 busy cores stall at every barrier: use 1 there")
    ap.add_argument("--quick", action="store_true", help="smoke run: batch 1 and 2, 64/8 tokens, 1 rep")
    ap.add_argument("--out", default=None, help="JSON path (default evals/results/engine_offline.json)")
    args = ap.parse_args()
    if args.quick:
        args.batch_sizes, args.prompt_len, args.output_len, args.reps = [1, 2], 64, 8, 1
    out_path = args.out or (os.path.join(tempfile.gettempdir(), "specpd_offline_quick.json") if args.quick
                            else os.path.join(RESULTS_DIR, "engine_offline.json"))
    if args.threads:
        torch.set_num_threads(args.threads)
    log(f"torch threads: {torch.get_num_threads()} (interop {torch.get_num_interop_threads()})")
    machine, code_versions = machine_info(), versions()

    ckpt = load_checkpoint("default")
    max_batch = max(args.batch_sizes)
    prompts, prompt_source = real_text_prompts(ckpt.tokenizer, max_batch, args.prompt_len)
    max_len = args.prompt_len + args.output_len
    runners = {}  # (engine, config label) -> runner
    for dtype in args.dtypes:
        if "specpd" in args.engines:
            runners[("specpd", dtype)] = SpecpdRunner(ckpt, dtype, max_batch, max_len, num_threads=args.threads)
        if "hf" in args.engines:
            runners[("hf", dtype)] = HFRunner(ckpt, dtype)
    if "specpd" in args.engines:
        for quant in args.quantizations:
            runners[("specpd", label(QUANT_DTYPE, quant))] = SpecpdRunner(ckpt, QUANT_DTYPE, max_batch, max_len,
                                                                          quant, num_threads=args.threads)
    configs = list(runners)

    log("warmup")
    for runner in runners.values():
        runner.run(prompts[:1], 4)
        for b in args.batch_sizes:
            runner.run([p[:32] for p in prompts[:b]], 2)

    raw: dict[tuple, list[dict]] = {(e, d, b): [] for (e, d) in configs for b in args.batch_sizes}
    t_start = time.perf_counter()
    for rep in range(args.reps):
        order = configs[rep % len(configs):] + configs[:rep % len(configs)]
        for b in args.batch_sizes:
            for engine, cfg in order:
                row = measure(runners[(engine, cfg)], prompts[:b], args.output_len)
                raw[(engine, cfg, b)].append(row)
                log(f"rep {rep} batch {b:>3} {engine:>6} {cfg:>13}: {row['tokens_per_s']:7.1f} tok/s  "
                    f"decode {row['decode_tokens_per_s']:7.1f} tok/s  ttft {row['ttft_s']:6.2f}s  "
                    f"load {row['loadavg_1m']:.1f}")
    bench_s = time.perf_counter() - t_start

    results = summarize(raw, runners)
    ratios, checks = compare(raw, results, args)

    spec_cfg = next(({k: v for k, v in r.config.to_dict().items() if k not in ("dtype", "quantization")}
                     for r in runners.values() if isinstance(r, SpecpdRunner)), None)  # those vary per row
    hf_attn = next((r.attn_implementation for r in runners.values() if isinstance(r, HFRunner)), None)
    report = {
        "benchmark": "offline",
        "model": "SmolLM2-135M-Instruct (default, Q4_1 GGUF; dense configs dequantize it, +int4 keeps its 4-bit codes)",
        "prompt_source": prompt_source, "prompt_len": args.prompt_len, "output_len": args.output_len,
        "batch_sizes": args.batch_sizes, "reps": args.reps, "quick": args.quick,
        "sampling": "greedy, ignore_eos", "bench_wall_s": round(bench_s, 1),
        "machine": machine, "versions": code_versions,
        "specpd_engine_config": spec_cfg, "hf_attn_implementation": hf_attn,
        "results": results, "ratios": ratios, "checks": checks,
    }
    write_json(out_path, report)
    print_table(results, ratios, checks)
    log(f"wrote {out_path}")


def summarize(raw: dict[tuple, list[dict]], runners: dict) -> list[dict]:
    results = []
    for (engine, cfg, b), rows in raw.items():
        runner = runners[engine, cfg]
        dtype, quant = (runner.config.dtype, runner.config.quantization) if engine == "specpd" else (cfg, "none")
        entry = {"engine": engine, "config": cfg, "dtype": dtype, "quantization": quant, "batch_size": b,
                 "reps": len(rows)}
        for field in ("tokens_per_s", "decode_tokens_per_s", "ttft_s"):
            entry[field] = median([r[field] for r in rows])
            entry[field + "_all"] = [round(r[field], 3) for r in rows]
        entry["loadavg_1m_all"] = [round(r["loadavg_1m"], 2) for r in rows]
        results.append(entry)
    return results


def compare(raw: dict[tuple, list[dict]], results: list[dict], args) -> tuple[dict, dict]:
    """Ratios of medians, plus `_paired`: the median over reps of the ratio within one rep (robust to
    load drifting between reps). specpd vs HF is reported same-dtype (a quantized config against HF at
    its activation dtype) and best-vs-best (each engine's fastest config). Checks: greedy agreement of
    the batch-1 outputs (specpd vs HF at the same dtype; a quantized config also vs specpd dense)."""
    by = {(r["engine"], r["config"], r["batch_size"]): r for r in results}
    spec_cfgs = sorted({c for e, c, _ in by if e == "specpd"})
    hf_cfgs = sorted({c for e, c, _ in by if e == "hf"})
    fields = (("tokens_per_s", "e2e"), ("decode_tokens_per_s", "decode"))

    def dtype_of(cfg: str) -> str:
        return cfg.split("+")[0]

    def paired(cfg: str, b: int, field: str) -> float:
        return median([x[field] / y[field] for x, y in zip(raw["specpd", cfg, b], raw["hf", dtype_of(cfg), b])])

    ratios, checks = {}, {}
    for b in args.batch_sizes:
        tags = fields if b > 1 else fields[1:]  # batch 1: decode speed is the headline
        for cfg in (c for c in spec_cfgs if dtype_of(c) in hf_cfgs):
            for field, tag in tags:
                ratios[f"specpd_over_hf_b{b}_{tag}_{cfg}"] = (by["specpd", cfg, b][field]
                                                              / by["hf", dtype_of(cfg), b][field])
                ratios[f"specpd_over_hf_b{b}_{tag}_{cfg}_paired"] = paired(cfg, b, field)
        if spec_cfgs and hf_cfgs:
            for field, tag in tags:
                best = {e: max(cfgs, key=lambda c: by[e, c, b][field]) for e, cfgs in (("specpd", spec_cfgs),
                                                                                         ("hf", hf_cfgs))}
                ratios[f"specpd_over_hf_b{b}_{tag}_best"] = (by["specpd", best["specpd"], b][field]
                                                             / by["hf", best["hf"], b][field])
                ratios[f"best_configs_b{b}_{tag}"] = best
    if 1 in args.batch_sizes:
        for b in (b for b in args.batch_sizes if b > 1):
            for cfg in spec_cfgs:
                for field, tag in fields:
                    ratios[f"specpd_b{b}_over_b1_{tag}_{cfg}"] = (by["specpd", cfg, b][field]
                                                                  / by["specpd", cfg, 1][field])
        for cfg in spec_cfgs:
            ours = raw["specpd", cfg, 1][0]["outputs"][0]
            refs = [("hf", dtype_of(cfg))] if dtype_of(cfg) in hf_cfgs else []
            if cfg != dtype_of(cfg) and dtype_of(cfg) in spec_cfgs:
                refs.append(("specpd", dtype_of(cfg)))  # quantized vs dense
            for engine, ref_cfg in refs:
                ref = raw[engine, ref_cfg, 1][0]["outputs"][0]
                checks[f"b1_greedy_common_prefix_{cfg}_vs_{engine}_{ref_cfg}"] = (
                    f"{common_prefix(ours, ref)}/{args.output_len}")
    return ratios, checks


def print_table(results: list[dict], ratios: dict, checks: dict) -> None:
    print("| engine | config | batch | end-to-end tok/s | decode tok/s | TTFT s |")
    print("|---|---|---|---|---|---|")
    for r in sorted(results, key=lambda r: (r["batch_size"], r["config"], r["engine"])):
        print(f"| {r['engine']} | {r['config']} | {r['batch_size']} | {r['tokens_per_s']:.1f} "
              f"| {r['decode_tokens_per_s']:.1f} | {r['ttft_s']:.2f} |")
    for k, v in {**ratios, **checks}.items():
        print(f"{k}: {v:.3f}" if isinstance(v, float) else f"{k}: {v}")


if __name__ == "__main__":
    main()
