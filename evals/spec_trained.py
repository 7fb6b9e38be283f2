"""`python -m evals.spec --draft-model default`: a trained draft head vs no speculation, wall clock.

Held-out ShareGPT prompts (never trained on; first human turn, chat-rendered), greedy, ignore_eos so every
config generates the same number of tokens; batch 1 and 8; configs interleaved rep by rep in a rotating
order; outputs must equal the base engine's token for token. Writes evals/results/spec_trained.json.
"""
from __future__ import annotations

import os
import time

import torch
from evals.harness.prompts import held_out_sharegpt_prompts
from evals.harness.results import log, machine_info, versions, write_json
from evals.spec_runs import Bench, compare, interleaved_reps, summarize  # the replay bench's runner

from specpd.config import SpecConfig
from specpd.spec.draft.loader import read_draft_config, resolve_draft_path
from specpd.model.loader import load_checkpoint

RESULTS_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")


def run_trained(args) -> None:
    torch.set_num_threads(args.threads)
    machine, code_versions = machine_info(), versions()
    t_start = time.perf_counter()
    ckpt = load_checkpoint("default")
    max_batch = max(args.batch_sizes)
    prompts = held_out_sharegpt_prompts(ckpt.tokenizer, max_batch, max_prompt_tokens=args.prompt_len)
    longest = max(map(len, prompts))
    num_pages = max_batch * -(-(longest + args.output_len + 32) // 16) + 8
    alg, draft = args.algorithm, args.draft_model
    configs = {"base": SpecConfig(),
               f"{alg}_chain_s{args.spec_steps}": SpecConfig(
                   alg, draft_model=draft, spec_num_steps=args.spec_steps, spec_ngram=False),
               f"{alg}_tree_k{args.tree_topk}_t{args.tree_tokens}": SpecConfig(
                   alg, draft_model=draft, spec_num_steps=args.spec_steps, spec_topk=args.tree_topk,
                   spec_num_draft_tokens=args.tree_tokens, spec_ngram=False)}
    benches = {name: Bench(name, ckpt, spec, (), num_pages, args.dtype) for name, spec in configs.items()}
    names = list(benches)
    for bench in benches.values():  # warmup
        bench.run([p[:32] for p in prompts[:2]], 6)
    reps = {b: args.reps_b1 if b == 1 else args.reps for b in args.batch_sizes}
    raw, _ = interleaved_reps(benches, prompts, args.output_len, args.batch_sizes, reps)  # base first
    results, ratios = summarize(raw), compare(raw, names, args.batch_sizes)
    draft_path = resolve_draft_path(draft, alg)
    b1 = min(args.batch_sizes)
    chain = names[1]
    report = {
        "benchmark": "spec_trained", "model": "SmolLM2-135M-Instruct (default, Q4_1 GGUF dequantized)",
        "dtype": args.dtype, "draft_model": draft, "draft_path": draft_path, "draft_config": read_draft_config(draft_path),
        "prompt_source": "held-out ShareGPT V3 (specpd.train.data.is_held_out), first human turn, chat template",
        "prompt_tokens": [len(p) for p in prompts], "output_len": args.output_len, "batch_sizes": args.batch_sizes,
        "reps": reps, "torch_num_threads": torch.get_num_threads(), "sampling": "greedy, ignore_eos",
        "configs": {n: {"speculative_algorithm": s.speculative_algorithm, "spec_num_steps": s.spec_num_steps,
                        "spec_topk": s.spec_topk, "num_draft_tokens": s.num_draft_tokens if s.enabled else None}
                    for n, s in configs.items()},
        "bench_wall_s": round(time.perf_counter() - t_start, 1), "machine": machine, "versions": code_versions,
        "results": results, "ratios": ratios,
        "target": {"metric": f"decode tok/s (wall clock), {chain} over base, batch {b1}", "required": 1.8,
                   "measured": ratios.get(f"{chain}_over_base_b{b1}_decode"),
                   "measured_paired": ratios.get(f"{chain}_over_base_b{b1}_decode_paired"),
                   "best_spec_over_base_b1": max(ratios.get(f"{n}_over_base_b{b1}_decode", 0) for n in names[1:])},
    }
    report["target"]["met"] = report["target"]["best_spec_over_base_b1"] >= 1.8
    out = args.out or os.path.join(RESULTS_DIR, "spec_trained.json")
    write_json(out, report)
    for r in results:
        log(f"{r['config']:>22} b{r['batch_size']}: decode {r['decode_tokens_per_s']:6.1f} tok/s  "
            f"tau {r.get('accept_length', 1.0):.2f}  lossless {r['lossless_all_reps']}")
    for k, v in ratios.items():
        if k.endswith("_decode") or k.endswith("_decode_paired"):
            log(f"  {k}: {v:.2f}x")
    log(f"wrote {out}")
