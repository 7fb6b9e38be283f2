"""How the EAGLE-3 head's acceptance grows with training data: the evidence for "data-limited".

The shipped head's recipe (2 epochs, lr 1e-3, 2048-token batches, 2 unrolled steps, 8192-id draft vocab)
on prefixes of its own 700k-token feature cache (`--feature-dir`; a smaller `--max-train-tokens` reads
exactly the conversations a fresh run with that budget would take), so the budget is the only variable.
Each run is evaluated like the shipped head (evals/spec_acceptance.py: 40 held-out ShareGPT prompts, 128
tokens, greedy, chain S=5 and tree K=4 T=16). A least-squares line tau = a + b * log10(tokens) through
the points gives the budget at which it would reach the issue's targets, if the trend held.

  python -m evals.spec_draft_scaling     # -> evals/results/spec_draft_scaling.json (trains and evaluates what is missing)
"""
from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys

EVALS_DIR = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(EVALS_DIR)
from evals.harness.results import log, machine_info, versions, write_json

RECIPE = ["--target", "default", "--algorithm", "eagle3", "--dataset", "sharegpt", "--max-seq-len", "1024",
          "--draft-vocab-size", "8192", "--epochs", "2", "--batch-tokens", "2048", "--lr", "1e-3",
          "--ttt-steps", "2", "--seed", "0", "--threads", "1", "--checkpoint-every", "50", "--no-progress"]
CONFIGS = ("chain_s5", "tree_k4_t16")
TARGETS = {"chain_s5": 2.0, "tree_k4_t16": 2.5}


def run(cmd: list[str]) -> None:
    log("$ " + " ".join(cmd))
    subprocess.run(cmd, check=True, cwd=REPO)


def fit(points: list[tuple[int, float]]) -> tuple[float, float]:
    """(a, b) of tau = a + b * log10(tokens), least squares."""
    xs, ys = [math.log10(n) for n, _ in points], [t for _, t in points]
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
    return my - b * mx, b


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--budgets", type=int, nargs="+", default=[87500, 175000, 350000, 700000])
    ap.add_argument("--feature-dir", default="runs/eagle3-smollm2-700k/features",
                    help="a feature cache holding at least the largest budget")
    ap.add_argument("--runs", default="runs", help="where the runs and their evaluations go")
    ap.add_argument("--out", default=os.path.join(EVALS_DIR, "results", "spec_draft_scaling.json"))
    args = ap.parse_args()
    rows = []
    for n in args.budgets:
        out_dir = os.path.join(args.runs, "eagle3-smollm2-700k" if n == 700000 else f"eagle3-scale-{n}")
        if not os.path.isfile(os.path.join(REPO, out_dir, "model.safetensors")):
            run([sys.executable, "-m", "specpd", "train-draft", *RECIPE, "--max-train-tokens", str(n),
                 "--feature-dir", args.feature_dir, "--out", out_dir])
        acc = os.path.join(args.runs, f"acc-scale-{n}.json")
        if not os.path.isfile(os.path.join(REPO, acc)):
            run([sys.executable, "-m", "evals.spec_acceptance", "--draft-model", out_dir, "--algorithm", "eagle3",
                 "--num-prompts", "40", "--max-tokens", "128", "--temperatures", "0", "--configs", ",".join(CONFIGS),
                 "--datasets", "sharegpt_held_out", "--out", acc])
        with open(os.path.join(REPO, out_dir, "train_log.jsonl"), encoding="utf-8") as f:
            last = [json.loads(line) for line in f if line.strip()][-1]
        with open(os.path.join(REPO, acc), encoding="utf-8") as f:
            res = json.load(f)["results"]
        row = {"max_train_tokens": n, "run": out_dir, "steps": last["step"], "train_acc0_last_batch": last["acc0"]}
        for c in CONFIGS:
            r = res[c]["sharegpt_held_out"]["0"]
            row[c] = {"tau": r["tau"], "accepted_at_depth": r["accepted_at_depth"]}
        rows.append(row)
        log(f"{n:>8} tokens: " + "  ".join(f"{c} tau {row[c]['tau']:.3f}" for c in CONFIGS))
    trend = {}
    for c in CONFIGS:
        a, b = fit([(r["max_train_tokens"], r[c]["tau"]) for r in rows])
        need = 10 ** ((TARGETS[c] - a) / b) if b > 0 else None
        trend[c] = {"tau_at_log10_tokens": [a, b], "tau_gain_per_doubling": b * math.log10(2),
                    "target": TARGETS[c], "tokens_for_target_if_trend_holds": need}
        log(f"{c}: tau = {a:.3f} + {b:.3f} log10(tokens); +{b * math.log10(2):.3f} per doubling; "
            f"tau {TARGETS[c]} at ~{need:.3g} tokens" if need else f"{c}: no growth")
    write_json(args.out, {"description": __doc__.split("\n\n")[0], "recipe": RECIPE, "feature_dir": args.feature_dir,
                          "eval": "40 held-out ShareGPT prompts, 128 tokens, greedy", "results": rows,
                          "trend": trend, "versions": versions(), "machine": machine_info()})
    log(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
