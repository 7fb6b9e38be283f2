"""Tensor parallelism's step time against TP 1 on this box, and the all-reduce's share of it.

`python -m evals.tp [--tp 3] [--batches 1 8] [--steps 24] [--rounds 5] [--prefill-tokens 512]`
  -> evals/results/tp.json
Two engines on the default model, the user's defaults but the TP size (dtype auto, attention auto, threads:
TP 1 takes every core, TP N the cores / N per rank), stay loaded side by side; every round times, for each batch
size, `--steps` decode steps of TP 1 and then of TP N (interleaved, fresh requests each round; prefill is not
timed). Rank 0's all-reduces are timed in the same steps (wall clock: it includes waiting for the slowest rank,
which is what a step pays). On a 2-core box TP is a correctness feature: three ranks share two cores, so the
ratio says what the split and its 2 x layers all-reduces cost per step, not what a machine with a core (or a
GPU) per rank would gain. Each round also times one prefill of a `--prefill-tokens` prompt at TP 1 and at TP N.
`--pairs 1:1,3:1,1:3,3:3` then serves real P and D servers of those TP sizes (the shipped EAGLE-3 head,
draft-on-both, Mooncake where it loads) and reads P's transfer counters: descriptors per request and per page
for each P->D pair (each P rank writes its heads into the D ranks holding them: one descriptor per page and
overlapping head range of the target's layers, one for the draft's; a whole page at TP 1 -> TP 1).
"""
from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

from evals.harness.results import command_line, log, machine_info, versions, write_json

from specpd.config import EngineConfig
from specpd.core import SamplingParams
from specpd.engine.llm_engine import LLMEngine
from specpd.model.loader import load_checkpoint

QUESTIONS = ["What is the capital of France, and what is it known for?", "Name three prime numbers.",
             "Write a haiku about rain.", "Explain what a hash table is.", "What is 17 times 23?",
             "Give me a recipe for pancakes.", "Who wrote Hamlet?", "Describe the water cycle."]


class AllReduceTimer:
    """Wraps rank 0's TPGroup.all_reduce; seconds and calls since the last reset."""

    def __init__(self, group):
        self.seconds, self.calls, inner = 0.0, 0, group.all_reduce

        def timed(x):
            t0 = time.perf_counter()
            try:
                return inner(x)
            finally:
                self.seconds += time.perf_counter() - t0
                self.calls += 1
        group.all_reduce = timed  # the layers call self.tp.all_reduce: the instance attribute wins


def decode_steps(engine: LLMEngine, prompts: list[list[int]], steps: int, timer: AllReduceTimer | None) -> dict:
    torch.set_num_threads(engine.runner.num_threads)  # process-wide: the two engines share this process
    params = SamplingParams(max_tokens=steps + 8, temperature=0.0, ignore_eos=True)
    ids = [f"r{time.monotonic_ns()}-{i}" for i in range(len(prompts))]
    for rid, prompt in zip(ids, prompts):
        engine.add_request(rid, prompt, params)
    while any(len(r.output_token_ids) == 0 for r in engine.scheduler.running) or engine.scheduler.waiting:
        engine.step()  # prefill (untimed) until every request decodes
    if timer is not None:
        timer.seconds, timer.calls = 0.0, 0
    t0 = time.perf_counter()
    for _ in range(steps):
        engine.step()
    wall = time.perf_counter() - t0
    for rid in ids:
        engine.abort_request(rid)
    while engine.has_unfinished_requests():
        engine.step()
    out = {"step_ms": 1000 * wall / steps}
    if timer is not None:
        out["all_reduce_ms"] = 1000 * timer.seconds / steps
        out["all_reduces_per_step"] = timer.calls / steps
    return out


def prefill_ms(engine: LLMEngine, prompt: list[int]) -> float:
    torch.set_num_threads(engine.runner.num_threads)
    t0 = time.perf_counter()
    engine.generate([prompt], SamplingParams(max_tokens=1, temperature=0.0))
    return 1000 * (time.perf_counter() - t0)


def descriptors(pairs: list[tuple[int, int]], prompts: list[list[int]]) -> list[dict]:
    """Per P:D TP pair: P's transfer counters after one greedy request per prompt through the router."""
    import httpx
    from evals.harness.servers import transfer_backend
    from evals.harness.servers import pd_cluster
    backend = transfer_backend("mooncake")
    args = ["--model", "default", "--page-size", "16", "--speculative-algorithm", "eagle3", "--draft-model",
            "default", "--draft-mode", "both", "--disable-prefix-caching"]  # every request sends all its pages
    rows = []
    for p_tp, d_tp in pairs:
        with pd_cluster(args, backend, p_tp, d_tp) as (router, p_url, _d_url):
            texts = []
            for prompt in prompts:
                resp = httpx.post(router + "/v1/completions", timeout=300, json={
                    "prompt": prompt, "max_tokens": 16, "temperature": 0, "ignore_eos": True})
                resp.raise_for_status()
                texts.append(resp.json()["choices"][0]["text"])
            info = httpx.get(p_url + "/server_info").json()
        pages = sum(-(-len(p) // 16) for p in prompts)
        kv = {k: info.get(k) for k in ("kv_transfers", "kv_descriptors", "kv_bytes")}
        rows.append({"prefill_tp": p_tp, "decode_tp": d_tp, "transfer_backend": backend, "requests": len(prompts),
                     "prompt_pages": pages, **kv, "descriptors_per_request": kv["kv_descriptors"] / len(prompts),
                     "descriptors_per_page": kv["kv_descriptors"] / pages, "texts": texts})
        log(f"P tp{p_tp} -> D tp{d_tp}: {rows[-1]['descriptors_per_page']:.2f} descriptors per page "
            f"({kv['kv_descriptors']} for {pages} pages, {kv['kv_bytes']} B)")
    same = all(r["texts"] == rows[0]["texts"] for r in rows)
    for r in rows:
        r["same_text_as_first_pair"] = same
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tp", type=int, default=3)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--steps", type=int, default=24)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--prefill-tokens", type=int, default=512)
    ap.add_argument("--pairs", default="1:1,3:1,1:3,3:3", help="P:D TP sizes for the descriptor count ('' skips)")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "tp.json"))
    args = ap.parse_args()
    info = {"machine": machine_info(), "versions": versions(), "command": command_line()}
    checkpoint = load_checkpoint("default")
    tok = checkpoint.tokenizer
    prompts = [tok.encode(tok.apply_chat_template([{"role": "user", "content": q}])) for q in QUESTIONS]
    one = LLMEngine(EngineConfig(model="default"), checkpoint=checkpoint)
    many = LLMEngine(EngineConfig(model="default", tp_size=args.tp), checkpoint=checkpoint)
    long_prompt = [t for p in prompts for t in p] * (args.prefill_tokens // sum(map(len, prompts)) + 2)
    timer = AllReduceTimer(many.runner.tp._group)
    log(f"tp1 threads {one.runner.num_threads}, tp{args.tp} threads per rank {many.runner.num_threads}")
    rows = {b: {"tp1": [], f"tp{args.tp}": []} for b in args.batches}
    prefill = {"tp1": [], f"tp{args.tp}": []}
    try:
        for rnd in range(args.rounds + 1):  # round 0 warms both
            for b in args.batches:
                batch = [prompts[i % len(prompts)] for i in range(b)]
                r1 = decode_steps(one, batch, args.steps, None)
                rn = decode_steps(many, batch, args.steps, timer)
                if rnd:
                    rows[b]["tp1"].append(r1)
                    rows[b][f"tp{args.tp}"].append(rn)
                if b == args.batches[-1]:
                    fresh = long_prompt[7 * rnd:7 * rnd + args.prefill_tokens]  # a new first page: no prefix-cache hit
                    got = [prefill_ms(e, fresh) for e in (one, many)]
                    if rnd:
                        for key, ms in zip(prefill, got):
                            prefill[key].append(ms)
                    log(f"round {rnd} prefill {args.prefill_tokens}: " + ", ".join(f"{k} {v:.0f} ms"
                                                                                 for k, v in zip(prefill, got)))
                log(f"round {rnd} b{b}: tp1 {r1['step_ms']:.1f} ms, tp{args.tp} {rn['step_ms']:.1f} ms "
                    f"(all-reduce {rn['all_reduce_ms']:.1f} ms)")
    finally:
        many.close()
    summary = {}
    for b, r in rows.items():
        t1 = [x["step_ms"] for x in r["tp1"]]
        tn = [x["step_ms"] for x in r[f"tp{args.tp}"]]
        ar = [x["all_reduce_ms"] for x in r[f"tp{args.tp}"]]
        ratios = [n / o for n, o in zip(tn, t1)]
        summary[f"b{b}"] = {"tp1_step_ms_median": statistics.median(t1),
                            f"tp{args.tp}_step_ms_median": statistics.median(tn),
                            f"tp{args.tp}_over_tp1_step_ratio_median": statistics.median(ratios),
                            "ratio_min_max": [min(ratios), max(ratios)],
                            "all_reduce_ms_median": statistics.median(ar),
                            "all_reduce_share_median": statistics.median(a / n for a, n in zip(ar, tn)),
                            "all_reduces_per_step": r[f"tp{args.tp}"][0]["all_reduces_per_step"]}
    summary["prefill"] = {f"{k}_ms_median": statistics.median(v) for k, v in prefill.items()}
    pairs = [tuple(int(x) for x in p.split(":")) for p in args.pairs.split(",") if p]
    info["pd_descriptors"] = descriptors(pairs, prompts[:4]) if pairs else []
    info.update(prefill_tokens=args.prefill_tokens, tp=args.tp, tp1_threads=one.runner.num_threads, tpn_threads_per_rank=many.runner.num_threads,
                dtype=one.runner.config.dtype, steps=args.steps, rounds=args.rounds, summary=summary, rounds_raw=rows)
    write_json(args.out, info)
    log(summary)


if __name__ == "__main__":
    main()
