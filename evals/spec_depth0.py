"""Where a round at depth 0 spends its time, against non-spec: timers around the engine's parts.

`python -m evals.spec_depth0 --configs non_spec hybrid mtp_hybrid random_hybrid --batch 8 --reps 3`
(`--workload grounded`: the grounded rewrite's long prompts instead of chat's)
  -> evals/results/spec_depth0.json
in the configuration a server takes on this machine (dtype, threads: specpd.machine), or `--dtype float32
--threads 1` as the earlier runs were made.
The configs (spec_workloads.configs) run held-out chat prompts in lockstep (one engine step each in turn, as
`spec.py --lockstep`), one warm rep then `--reps` measured ones, fresh prompts every rep: `--batch` at once,
or with `--closed-loop N`, N prompts through `--batch` clients (the next added as one finishes: arrivals and
finishes spread over the rounds, as a served benchmark's, and the ratio is every output token over all step time).
A config named `<config>_eager` is that config with every prompt's draft extend run at once (SpecRunner's
`defer_prompt_tokens` = 0: the engine before the prompt extend waited for the first catch-up);
`<config>_nocache`, that config with the prefix cache off.
`--one-at-a-time`: each config runs a rep's closed loop alone (the order rotated rep by rep), as a server does: in
lockstep an engine's round-to-round cycle, which the adaptive policy reads online, holds the other engines' steps.
Each engine's step, scheduler, target forward, sampling, the adaptive plan, the draft catch-ups and extends
are wrapped with timers (wall clock, or with `--clock thread` CPU time); the JSON
holds their milliseconds per engine step, the share of rounds at depth 0 and each rep's tok/s ratio to
non-spec. The parts nest (a plain round holds its target forward, which holds the model forward), so they
do not add up to the step.
"""
from __future__ import annotations

import argparse
import collections
import functools
import itertools
import os
import tempfile
import time

import torch

from evals.harness.results import log, machine_info, versions, write_json
from evals.spec_workloads import WORKLOADS, configs, lockstep_run

from specpd.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from specpd.core import SamplingParams
from specpd.spec.draft.loader import random_draft_checkpoint
from specpd.engine.llm_engine import LLMEngine
from specpd.machine import default_dtype, default_threads, wait_for_collapse
from specpd.model.loader import load_checkpoint


def timed(totals: collections.Counter, counts: collections.Counter, obj, attr: str, label: str,
          clock=time.perf_counter) -> None:
    """Wrap obj.attr so its time on `clock` accumulates in totals[label]."""
    f = getattr(obj, attr)

    @functools.wraps(f)
    def wrapper(*args, **kwargs):
        t0 = clock()
        try:
            return f(*args, **kwargs)
        finally:
            totals[label] += clock() - t0
            counts[label] += 1
    setattr(obj, attr, wrapper)


def instrument(engine: LLMEngine, clock=time.perf_counter) -> tuple[collections.Counter, collections.Counter]:
    totals, counts = collections.Counter(), collections.Counter()
    parts = [(engine, "step", "step"), (engine.scheduler, "schedule", "schedule"),
             (engine, "_postprocess", "postprocess"), (engine.runner, "sample_items", "sample_items"),
             (engine.runner.model, "forward", "model_forward"), (engine.runner.backend, "plan", "attention_plan")]
    sr = engine.spec_runner
    if sr is not None:
        parts += [(sr, "_target_forward", "target_forward"), (sr, "_plain_round", "plain_round"),
                  (sr, "_catch_up", "catch_up"),
                  (sr.proposer, "extend", "draft_extend"), (sr.proposer, "propose", "propose")]
        if sr.policy is not None:
            parts.append((sr.policy, "plan", "policy_plan"))
    else:
        parts.append((engine.runner, "forward", "runner_forward"))  # inputs, plan and the model's forward
    for obj, attr, label in parts:
        timed(totals, counts, obj, attr, label, clock)
    return totals, counts


_ALONE_TURNS = itertools.count()  # alone_run's calls: each rotates the order once more


def alone_run(engines: dict[str, LLMEngine], prompts: list[list[int]], params: SamplingParams, tag: str, clock,
              concurrency: int) -> dict[str, dict]:
    """Each engine through the closed loop on its own (lockstep_run of that engine alone), one after another, the
    order rotated call by call."""
    names, shift = list(engines), next(_ALONE_TURNS) % len(engines)
    return {n: lockstep_run({n: engines[n]}, prompts, params, tag, clock, concurrency)[n]
            for n in names[shift:] + names[:shift]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--configs", nargs="+", default=["non_spec", "hybrid", "random_hybrid"])
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--workload", default="chat", choices=sorted(WORKLOADS),
                    help="the prompts (spec_workloads.py): held-out chat, or the grounded rewrite's long inputs")
    ap.add_argument("--closed-loop", type=int, default=0, metavar="N",
                    help="N prompts a rep through --batch clients (a closed loop), not --batch at once")
    ap.add_argument("--one-at-a-time", action="store_true",
                    help="with --closed-loop: each config alone through a rep (module docstring), not in lockstep")
    ap.add_argument("--clock", default="wall", choices=["wall", "thread"],
                    help="thread: time the parts and steps in this thread's CPU time (leaves out the time the box "
                         "took the core away; the engines still decide on wall time)")
    ap.add_argument("--dtype", default=default_dtype(), help="the engines' dtype (default: what `specpd serve` "
                    "picks here: bfloat16 on an AMX / AVX512-BF16 box, else float32)")
    ap.add_argument("--threads", type=int, default=default_threads(),
                    help="torch threads (default: what `specpd serve` picks here, every usable core)")
    ap.add_argument("--out", default="evals/results/spec_depth0.json")
    args = ap.parse_args()
    if "non_spec" not in args.configs:
        raise SystemExit("--configs must include non_spec (the ratios' reference)")
    torch.set_num_threads(args.threads)
    ckpt = load_checkpoint("default")
    head = tempfile.mkdtemp(prefix="random-eagle3-")
    random_draft_checkpoint(head, "eagle3", ModelConfig.from_hf(ckpt.hf_config), seed=0, draft_vocab_size=8192)
    all_cfgs = configs(head)
    if args.one_at_a_time and not args.closed_loop:
        raise SystemExit("--one-at-a-time needs --closed-loop")
    engines = {n: LLMEngine(EngineConfig(model="default", dtype=args.dtype, num_threads=args.threads,
                                         spec=all_cfgs[n.removesuffix("_eager").removesuffix("_nocache")],
                                         cache=CacheConfig(page_size=16, num_pages=1024,
                                                           enable_prefix_caching=not n.endswith("_nocache")),
                                         scheduler=SchedulerConfig(max_running_requests=args.batch)),
                            checkpoint=ckpt) for n in args.configs}
    for n, eng in engines.items():
        if n.endswith("_eager"):
            eng.spec_runner.defer_prompt_tokens = 0
    wait_for_collapse()
    clock = time.thread_time if args.clock == "thread" else time.perf_counter
    timers = {n: instrument(e, clock) for n, e in engines.items()}
    params = SamplingParams(max_tokens=args.output_len, temperature=0.0)
    per_rep = args.closed_loop or args.batch
    prompts = WORKLOADS[args.workload](ckpt.tokenizer, per_rep * (args.reps + 1))
    loop = args.batch if args.closed_loop else None
    run = alone_run if args.one_at_a_time else lockstep_run
    run(engines, prompts[:per_rep], params, "warm", clock, loop)
    for totals, counts in timers.values():
        totals.clear()
        counts.clear()
    ratios = {n: [] for n in args.configs}
    rate = "tok_s" if loop else "decode_tok_s"
    differing: dict[str, int] = {}  # reps whose greedy output differed from non-spec's (half precision only)
    for rep in range(args.reps):
        batch = prompts[per_rep * (rep + 1):per_rep * (rep + 2)]
        out = run(engines, batch, params, f"rep{rep}", clock, loop)
        for n in args.configs:
            if out[n]["tokens"] != out["non_spec"]["tokens"]:
                # fp32 is exact; in half precision a prompt whose cached prefix differs by a page (a spec engine's
                # pages carry draft KV, so it matches one page less) attends its rest in other chunks, and a
                # near tie may flip (docs/prefix-caching.md)
                if args.dtype == "float32":
                    raise AssertionError(f"{n}'s output differs from non-spec's")
                differing[n] = differing.get(n, 0) + 1
            ratios[n].append(out[n][rate] / out["non_spec"][rate])
        log("rep", rep, {n: round(r[-1], 3) for n, r in ratios.items()})
    result = {"meta": {"machine": machine_info(), "versions": versions(), "args": vars(args),
                       "reps_with_outputs_unlike_non_spec": differing}, "configs": {}}
    for n, (totals, counts) in timers.items():
        steps = counts["step"]
        entry = {"steps": steps, "ratio_vs_non_spec": ratios[n],
                 "ms_per_step": {k: 1e3 * v / steps for k, v in sorted(totals.items(), key=lambda kv: -kv[1])},
                 "calls": dict(counts)}
        policy = engines[n].spec_runner.policy if engines[n].spec_runner is not None else None
        if policy is not None:
            entry["rounds_off_share"] = policy.stats.rounds_off / max(policy.stats.rounds, 1)
        result["configs"][n] = entry
        log(n, {k: round(v, 2) for k, v in entry["ms_per_step"].items()})
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    write_json(args.out, result)


if __name__ == "__main__":
    main()
