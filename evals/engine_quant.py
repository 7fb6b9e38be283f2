"""Quantized weights end to end on the default model (specpd/model/quant.py): greedy agreement with the dense fp32
engine on the same file, decode speed through `specpd generate`, and resident memory, by --quantization.

1. agreement: held-out ShareGPT prompts (evals.common.held_out_sharegpt_prompts: never trained on, chat-templated,
   at most 512 tokens), --tokens greedy tokens each (ignore_eos), all in one batch per engine: dense fp32 (the
   reference: `--quantization none --dtype float32`), the GGUF's blocks with fp32 and with bf16 activations, and
   dense bf16 (what bf16 rounding alone does, for scale). Per configuration: the share of tokens inside the
   common prefix with the reference, the prompts whose first token agrees, the tokens equal position by position.
2. speed: `specpd generate --model default --chat --prompt P --max-new-tokens 128 --ignore-eos --json` in a fresh
   process per run, --quantization none against auto (the GGUF's blocks), at the box's default dtype and at
   float32 (what an AVX2 box defaults to), at the box's default threads and at one, the configurations
   interleaved in every repetition; medians of
   tokens_per_s (the decode rate), ttft_s and load_s (start to ready), and the best decode rate (on a shared
   box, the run its neighbours disturbed least).
3. memory: a child process per configuration builds the engine as `specpd generate` does and reports its
   resident set after start-up and after one generation, and its peak (VmRSS, VmHWM).

    .venv/bin/python -m evals.engine_quant [--parts agreement speed memory]   -> evals/results/engine_quant.json
(a part not run keeps its entry from the file already there: the speed part can be rerun on a quieter box)
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

from evals.harness.results import REPO_ROOT, log, machine_info, versions, write_json

OUT = os.path.join(REPO_ROOT, "evals", "results", "engine_quant.json")
PROMPT = "Explain how a hash map works, with a short example in Python."
# (label, dtype, quantization) of the agreement runs; the first is the reference
AGREEMENT = [("dense fp32", "float32", "none"), ("gguf, fp32 activations", "float32", "gguf"),
             ("gguf, bf16 activations", "bfloat16", "gguf"), ("dense bf16", "bfloat16", "none")]


def agreement(num_prompts: int, tokens: int) -> dict:
    from evals.harness.prompts import held_out_sharegpt_prompts
    from specpd.config import CacheConfig, EngineConfig
    from specpd.core import SamplingParams
    from specpd.engine.llm_engine import LLMEngine
    from specpd.model.loader import load_checkpoint
    ckpt = load_checkpoint("default")
    prompts = held_out_sharegpt_prompts(ckpt.tokenizer, num_prompts)
    params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
    pages = sum(-(-(len(p) + tokens) // 16) for p in prompts) + 8
    outs = {}
    for label, dtype, method in AGREEMENT:
        engine = LLMEngine(EngineConfig(model="default", dtype=dtype, quantization=method,
                                        cache=CacheConfig(page_size=16, num_pages=pages)), checkpoint=ckpt)
        outs[label] = [o.token_ids for o in engine.generate(prompts, params)]
        log("agreement", label, "done")
    ref = outs[AGREEMENT[0][0]]
    rows = {}
    for label, _, _ in AGREEMENT[1:]:
        prefixes = [next((i for i, (a, b) in enumerate(zip(x, y)) if a != b), len(x)) for x, y in zip(outs[label], ref)]
        same = sum(a == b for x, y in zip(outs[label], ref) for a, b in zip(x, y))
        rows[label] = {"common_prefix_share": round(sum(prefixes) / (len(prompts) * tokens), 3),
                       "first_token_agrees": sum(p > 0 for p in prefixes), "identical_outputs": prefixes.count(tokens),
                       "positional_agreement": round(same / (len(prompts) * tokens), 3), "common_prefixes": prefixes}
        log(label, {k: v for k, v in rows[label].items() if k != "common_prefixes"})
    return {"reference": AGREEMENT[0][0], "prompts": len(prompts), "tokens": tokens, "vs_reference": rows}


def generate(quantization: str, dtype: str | None, threads: int | None, tokens: int) -> dict:
    cmd = [sys.executable, "-m", "specpd", "generate", "--model", "default", "--chat", "--prompt", PROMPT,
           "--max-new-tokens", str(tokens), "--ignore-eos", "--json", "--quantization", quantization]
    if dtype:
        cmd += ["--dtype", dtype]
    if threads:
        cmd += ["--num-threads", str(threads)]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=REPO_ROOT, check=True)
    return json.loads(out.stdout)


def speed(reps: int, tokens: int) -> list[dict]:
    """The box's default threads, and one thread (on a shared box a process of one thread is slowed by its
    neighbours in proportion; two OpenMP threads wait at every barrier for the one descheduled)."""
    configs = [(q, d, t) for t in (None, 1) for d in (None, "float32") for q in ("none", "auto")]
    runs = {c: [] for c in configs}
    for rep in range(reps):
        for c in configs:
            runs[c].append(generate(*c, tokens))
        log("speed rep", rep + 1, {f"{q}/{d or 'default'}/{t or 'default'}": round(r[-1]["tokens_per_s"], 1)
                                   for (q, d, t), r in runs.items()})
    rows = []
    for (q, d, t), rs in runs.items():
        runtime = rs[0]["stats"]["runtime"]
        rows.append({"quantization": q, "dtype_flag": d or "default", "threads_flag": t or "default",
                     "resolved": runtime["quantization"],
                     "dtype": runtime["dtype"], "threads": runtime["num_threads"],
                     "weight_formats": runtime["weight_formats"],
                     **{f"{k}_median": round(statistics.median(r[k] for r in rs), 4)
                        for k in ("tokens_per_s", "ttft_s", "load_s")},
                     "tokens_per_s_best": round(max(r["tokens_per_s"] for r in rs), 1),  # the least disturbed run
                     "tokens_per_s_all": [round(r["tokens_per_s"], 1) for r in rs]})
    return rows


MEMORY_CHILD = """
import json, sys
from specpd.config import EngineConfig
from specpd.core import SamplingParams
from specpd.engine.llm_engine import LLMEngine
def status():
    with open("/proc/self/status") as f:
        return {k: int(v.split()[0]) // 1024 for k, v in (l.split(":", 1) for l in f) if k in ("VmRSS", "VmHWM")}
engine = LLMEngine(EngineConfig(model="default", quantization=sys.argv[1], dtype=sys.argv[2]))
started = status()
engine.generate([[1, 2, 3]], SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True))
print(json.dumps({"rss_started_mib": started["VmRSS"], "rss_after_generate_mib": status()["VmRSS"],
                  "peak_mib": status()["VmHWM"], "runtime": engine.runner.runtime_info()}))
"""


def memory() -> list[dict]:
    rows = []
    for q in ("none", "gguf", "int8", "int4"):
        for dtype in ("float32", "bfloat16"):
            out = subprocess.run([sys.executable, "-c", MEMORY_CHILD, q, dtype], capture_output=True, text=True,
                                 timeout=600, cwd=REPO_ROOT, check=True)
            row = {"quantization": q, "dtype": dtype, **json.loads(out.stdout.strip().splitlines()[-1])}
            row["weight_formats"] = row.pop("runtime")["weight_formats"]
            rows.append(row)
            log("memory", q, dtype, {k: v for k, v in row.items() if k.endswith("mib")})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--speed-tokens", type=int, default=128)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--parts", nargs="+", default=["agreement", "speed", "memory"],
                    choices=["agreement", "speed", "memory"])
    ap.add_argument("--out", default=OUT)
    args = ap.parse_args()
    from specpd.kernels.cpu_gemm_q import path
    from specpd.machine import isa
    meta = {"machine": machine_info(), "isa": isa(), "q_kernel_path": path(), "versions": versions(),
            "generate_prompt": PROMPT, "speed_tokens": args.speed_tokens, "reps": args.reps}
    result = {}
    if os.path.exists(args.out):
        with open(args.out) as f:
            result = json.load(f)
    runs = {"agreement": lambda: agreement(args.prompts, args.tokens),
            "speed": lambda: speed(args.reps, args.speed_tokens), "memory": memory}
    for part in args.parts:
        load_start = round(os.getloadavg()[0], 2)
        result[part] = runs[part]()
        # the box is shared: its 1-minute load average before and after the part ran
        meta[f"{part}_load_average_1m"] = [load_start, round(os.getloadavg()[0], 2)]
    result["meta"] = {**result.get("meta", {}), **meta}
    write_json(args.out, result)
    log("wrote", args.out)


if __name__ == "__main__":
    main()
