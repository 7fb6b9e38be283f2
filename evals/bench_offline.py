"""Offline throughput: specpd vs HF transformers `generate` on the same weights (the default model,
SmolLM2-135M-Instruct), greedy, EOS ignored, prompts of exactly --prompt-len tokens of ShareGPT text.

Every config runs in this one process and the configs are interleaved rep by rep, in a rotating
order (the machine is shared and noisy); medians over reps are reported.
  tok/s (end-to-end, prefill included) = N * out / t_total
  TTFT    = time until every request of the batch has its first token (batch 1: the usual TTFT)
  decode tok/s (prefill excluded) = N * (out - 1) / (t_total - TTFT)

  python evals/bench_offline.py           # full run -> evals/results/offline.json
  python evals/bench_offline.py --quick   # smoke run (short prompts, 1 rep) -> $TMPDIR, not results/
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

import torch

EVALS_DIR = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [EVALS_DIR, os.path.dirname(EVALS_DIR)]  # runnable without `pip install -e .`
from common import log, machine_info, median, real_text_prompts, versions, write_json  # noqa: E402

from specpd.config import CacheConfig, EngineConfig  # noqa: E402
from specpd.core import SamplingParams  # noqa: E402
from specpd.engine.llm_engine import LLMEngine  # noqa: E402
from specpd.model.loader import load_checkpoint  # noqa: E402

RESULTS_DIR = os.path.join(EVALS_DIR, "results")
TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


class SpecpdRunner:
    engine_name = "specpd"

    def __init__(self, ckpt, dtype: str, max_batch: int, max_len: int, page_size: int = 16):
        pages = max_batch * -(-max_len // page_size) + 8
        self.config = EngineConfig(model="default", dtype=dtype,
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
    ap.add_argument("--engines", nargs="+", default=["specpd", "hf"], choices=["specpd", "hf"])
    ap.add_argument("--threads", type=int, default=None,
                    help="torch.set_num_threads (default: torch's own, = usable cores). On a shared machine "
                         "2 OpenMP threads on 2 busy cores stall at every barrier: use 1 there")
    ap.add_argument("--quick", action="store_true", help="smoke run: batch 1 and 2, 64/8 tokens, 1 rep")
    ap.add_argument("--out", default=None, help="JSON path (default evals/results/offline.json)")
    args = ap.parse_args()
    if args.quick:
        args.batch_sizes, args.prompt_len, args.output_len, args.reps = [1, 2], 64, 8, 1
    out_path = args.out or (os.path.join(tempfile.gettempdir(), "specpd_offline_quick.json") if args.quick
                            else os.path.join(RESULTS_DIR, "offline.json"))
    if args.threads:
        torch.set_num_threads(args.threads)
    log(f"torch threads: {torch.get_num_threads()} (interop {torch.get_num_interop_threads()})")
    machine, code_versions = machine_info(), versions()

    ckpt = load_checkpoint("default")
    max_batch = max(args.batch_sizes)
    prompts, prompt_source = real_text_prompts(ckpt.tokenizer, max_batch, args.prompt_len)
    runners = {}
    for dtype in args.dtypes:
        if "specpd" in args.engines:
            runners[("specpd", dtype)] = SpecpdRunner(ckpt, dtype, max_batch, args.prompt_len + args.output_len)
        if "hf" in args.engines:
            runners[("hf", dtype)] = HFRunner(ckpt, dtype)
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
            for engine, dtype in order:
                row = measure(runners[(engine, dtype)], prompts[:b], args.output_len)
                raw[(engine, dtype, b)].append(row)
                log(f"rep {rep} batch {b:>3} {engine:>6} {dtype:>8}: {row['tokens_per_s']:7.1f} tok/s  "
                    f"decode {row['decode_tokens_per_s']:7.1f} tok/s  ttft {row['ttft_s']:6.2f}s  "
                    f"load {row['loadavg_1m']:.1f}")
    bench_s = time.perf_counter() - t_start

    results = summarize(raw)
    ratios, checks = compare(raw, results, args)

    spec_cfg = next(({k: v for k, v in r.config.to_dict().items() if k != "dtype"}  # dtype varies per row
                     for r in runners.values() if isinstance(r, SpecpdRunner)), None)
    hf_attn = next((r.attn_implementation for r in runners.values() if isinstance(r, HFRunner)), None)
    report = {
        "benchmark": "offline", "model": "SmolLM2-135M-Instruct (default, Q4_1 GGUF dequantized)",
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


def summarize(raw: dict[tuple, list[dict]]) -> list[dict]:
    results = []
    for (engine, dtype, b), rows in raw.items():
        entry = {"engine": engine, "dtype": dtype, "batch_size": b, "reps": len(rows)}
        for field in ("tokens_per_s", "decode_tokens_per_s", "ttft_s"):
            entry[field] = median([r[field] for r in rows])
            entry[field + "_all"] = [round(r[field], 3) for r in rows]
        entry["loadavg_1m_all"] = [round(r["loadavg_1m"], 2) for r in rows]
        results.append(entry)
    return results


def compare(raw: dict[tuple, list[dict]], results: list[dict], args) -> tuple[dict, dict]:
    """Ratios of medians, plus `_paired`: the median over reps of the ratio within one rep (robust to
    load drifting between reps). Checks: greedy agreement of specpd with HF on the batch-1 prompt."""
    by = {(r["engine"], r["dtype"], r["batch_size"]): r for r in results}
    both = set(args.engines) == {"specpd", "hf"}
    fields = (("tokens_per_s", "e2e"), ("decode_tokens_per_s", "decode"))

    def paired(d: str, b: int, field: str) -> float:
        return median([x[field] / y[field] for x, y in zip(raw["specpd", d, b], raw["hf", d, b])])

    ratios, checks = {}, {}
    if both and 1 in args.batch_sizes:
        for d in args.dtypes:
            ratios[f"specpd_over_hf_b1_decode_{d}"] = (by["specpd", d, 1]["decode_tokens_per_s"]
                                                       / by["hf", d, 1]["decode_tokens_per_s"])
            ratios[f"specpd_over_hf_b1_decode_{d}_paired"] = paired(d, 1, "decode_tokens_per_s")
            a, h = raw["specpd", d, 1][0]["outputs"][0], raw["hf", d, 1][0]["outputs"][0]
            checks[f"b1_greedy_common_prefix_{d}"] = f"{common_prefix(a, h)}/{args.output_len}"
        best = {e: max(args.dtypes, key=lambda d: by[e, d, 1]["decode_tokens_per_s"]) for e in ("specpd", "hf")}
        ratios["specpd_over_hf_b1_decode_best"] = (by["specpd", best["specpd"], 1]["decode_tokens_per_s"]
                                                   / by["hf", best["hf"], 1]["decode_tokens_per_s"])
        ratios["best_dtypes_b1_decode"] = best
    for b in (b for b in args.batch_sizes if b > 1):
        for d in args.dtypes:
            for field, tag in fields:
                if "specpd" in args.engines and 1 in args.batch_sizes:
                    ratios[f"specpd_b{b}_over_b1_{tag}_{d}"] = by["specpd", d, b][field] / by["specpd", d, 1][field]
                if both:
                    ratios[f"specpd_over_hf_b{b}_{tag}_{d}"] = by["specpd", d, b][field] / by["hf", d, b][field]
                    ratios[f"specpd_over_hf_b{b}_{tag}_{d}_paired"] = paired(d, b, field)
    return ratios, checks


def print_table(results: list[dict], ratios: dict, checks: dict) -> None:
    print("| engine | dtype | batch | end-to-end tok/s | decode tok/s | TTFT s |")
    print("|---|---|---|---|---|---|")
    for r in sorted(results, key=lambda r: (r["batch_size"], r["dtype"], r["engine"])):
        print(f"| {r['engine']} | {r['dtype']} | {r['batch_size']} | {r['tokens_per_s']:.1f} "
              f"| {r['decode_tokens_per_s']:.1f} | {r['ttft_s']:.2f} |")
    for k, v in {**ratios, **checks}.items():
        print(f"{k}: {v:.3f}" if isinstance(v, float) else f"{k}: {v}")


if __name__ == "__main__":
    main()
