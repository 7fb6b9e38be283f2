"""Pick the default draft shapes (specpd.config.DEFAULT_SHAPES) on TRAINING-split prompts only
(`python -m evals.spec_tuning` -> evals/results/spec_tuning.json).

For EAGLE-3 and MTP (chat workload), the hybrid (EAGLE-3 with n-gram candidates merged: the EAGLE family's
default) and ngram (grounded workload), batch 1, adaptive on, at the torch threads `specpd serve` runs with here
(`--threads`; runs before this option were at 1): every candidate shape runs with non-spec on the same prompt in
lockstep (spec_workloads.lockstep_run: the engines take one step each in turn, each timed by its own steps),
prompt by prompt; the shape with the best median ratio is the default. The reported numbers
(evals/spec_workloads.py) use the held-out split, never these prompts. Each run updates its algorithms' entries of
the result file (each with its own meta) and keeps the others'.
"""
from __future__ import annotations

import argparse
import json
import os

EVALS_DIR = os.path.dirname(os.path.abspath(__file__))
from evals.harness.results import log, machine_info, median, versions, write_json
from evals.spec_workloads import WORKLOADS, lockstep_run

import torch

from specpd.config import CacheConfig, EngineConfig, SpecConfig
from specpd.core import SamplingParams
from specpd.engine.llm_engine import LLMEngine
from specpd.machine import wait_for_collapse

SHAPES = {  # (steps, topk, tokens[, n-gram min match])
    "eagle3": [(2, 1, 3), (3, 1, 4), (4, 1, 5), (2, 2, 4), (3, 2, 6), (2, 4, 5), (3, 3, 6), (3, 4, 8), (4, 4, 12)],
    "mtp": [(2, 1, 3), (3, 1, 4), (4, 1, 5), (3, 2, 6), (2, 4, 5), (3, 4, 8)],
    "ngram": [(4, 1, 5), (8, 1, 9), (12, 1, 13), (6, 2, 12), (8, 3, 16), (6, 2, 12, 1), (8, 1, 9, 1), (10, 1, 11, 1),
              (8, 3, 16, 1)],
    "hybrid": [(2, 1, 3), (3, 1, 4), (2, 2, 3), (2, 3, 4), (2, 4, 4), (2, 4, 5), (2, 4, 6), (3, 2, 5), (3, 2, 6),
               (3, 4, 6), (3, 4, 8), (4, 4, 10)],
}
WORKLOAD = {"eagle3": "chat", "mtp": "chat", "ngram": "grounded", "hybrid": "chat"}


def spec_config(alg: str, s: int, k: int, t: int, min_match: int = 2) -> SpecConfig:
    if alg == "hybrid":
        return SpecConfig("eagle3", draft_model="default", spec_num_steps=s, spec_topk=k, spec_num_draft_tokens=t,
                          spec_ngram=True, spec_ngram_min_match=min_match)
    return SpecConfig(alg, draft_model=None if alg == "ngram" else "default", spec_num_steps=s, spec_topk=k,
                      spec_num_draft_tokens=t, spec_ngram=False, spec_ngram_min_match=min_match)  # a head's own shape


def shape_name(shape: tuple[int, ...]) -> str:
    """S6_K2_T12; with a min match other than 2 (spec_config's default here), S6_K2_T12_M1."""
    name = "S{}_K{}_T{}".format(*shape[:3])
    return name if len(shape) < 4 or shape[3] == 2 else f"{name}_M{shape[3]}"


def candidates(alg: str, names: str | None) -> list[tuple[int, ...]]:
    """SHAPES[alg], or the shapes `names` (comma-separated shape_name strings) gives."""
    if names is None:
        return SHAPES[alg]
    shapes = []
    for name in names.split(","):
        parts = name.strip().split("_")
        try:
            shape = tuple(int(p[1:]) for p in parts)
        except ValueError:
            shape = ()
        if len(shape) not in (3, 4) or [p[0] for p in parts] != ["S", "K", "T", "M"][:len(shape)]:
            raise SystemExit(f"--shapes: {name!r} is not a shape name like S2_K4_T5 or S8_K1_T9_M1")
        shapes.append(shape)
    return shapes


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--algorithms", nargs="+", default=["eagle3", "ngram"])
    ap.add_argument("--num-prompts", type=int, default=4)
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: what specpd serve takes here)")
    ap.add_argument("--shapes", default=None, help="only these candidates, e.g. S2_K4_T5,S2_K4_T6 (a run over one "
                    "algorithm: a second look at the best few with more prompts)")
    ap.add_argument("--out", default=os.path.join(EVALS_DIR, "results", "spec_tuning.json"))
    args = ap.parse_args()
    from specpd.machine import default_threads
    args.threads = args.threads or default_threads()
    torch.set_num_threads(args.threads)
    from specpd.model.loader import load_checkpoint
    ckpt = load_checkpoint("default")
    params = SamplingParams(max_tokens=args.output_len, temperature=0.0)
    meta = {"machine": machine_info(), "versions": versions(), "args": vars(args), "split": "train"}
    out = {}
    if os.path.exists(args.out):  # the other algorithms' entries stay
        with open(args.out, encoding="utf-8") as f:
            out = json.load(f)
    out["meta"] = meta
    for alg in args.algorithms:
        # each rep its own prompts: an n-gram store (ngram, hybrid) keeps earlier outputs, and the same prompt again
        # would find its own last reply there (a hybrid rep over repeated prompts read 2.1x against 1.2-1.4x)
        prompts = WORKLOADS[WORKLOAD[alg]](ckpt.tokenizer, args.num_prompts * args.reps, "train")
        engines = {"non_spec": LLMEngine(EngineConfig(model="default", cache=CacheConfig(num_pages=512)), checkpoint=ckpt)}
        for shape in candidates(alg, args.shapes):
            spec = spec_config(alg, *shape)
            engines[shape_name(shape)] = LLMEngine(EngineConfig(model="default", spec=spec,
                                                                cache=CacheConfig(num_pages=512)), checkpoint=ckpt)
        wait_for_collapse()
        ratios = {n: [] for n in engines if n != "non_spec"}
        for rep in range(args.reps):
            for i, prompt in enumerate(prompts[rep * args.num_prompts:(rep + 1) * args.num_prompts]):
                res = lockstep_run(engines, [prompt], params, f"tune-{alg}-{rep}-{i}")
                for n in ratios:
                    assert res[n]["tokens"] == res["non_spec"]["tokens"], n
                    ratios[n].append(res[n]["decode_tok_s"] / res["non_spec"]["decode_tok_s"])
            log(alg, rep, {n: round(median(r), 2) for n, r in ratios.items()})
        summary = {n: {"vs_non_spec": median(r), "spread": [min(r), max(r)]} for n, r in ratios.items()}
        best = max(summary, key=lambda n: summary[n]["vs_non_spec"])
        out[alg] = {"workload": WORKLOAD[alg], "shapes": summary, "best": best, "meta": meta}
        log(alg, "best", best, summary[best])
        write_json(args.out, out)


if __name__ == "__main__":
    main()
