"""Speculative vs non-speculative 1P1D TPOT, interleaved: every config's cluster up at once, passes in turn.

`pd.py --rounds` runs one config after another, each on a fresh cluster, ~3 minutes apiece with its
mixed workload. This box moved non-spec PD TPOT from 64 to 143 ms within one hour, so one round's ratio
read anywhere from 0.48 to 1.63 and nine rounds could not settle a 10% difference. Here every config's
servers start first, one cluster after another. Each cluster pins P to core 0 and D to core 1, with one
torch thread each. A cluster not being measured is idle: its engine loops wait on their queues and no
heartbeat runs while D owes nothing, which `idle_cpu_s` below checks. Each cluster runs --warm passes of
the short workload (a fresh cluster's first passes read slower), then the short workload runs --passes
times per config. The order rotates per cycle (ABBA for two configs), so a pass of one config is never
more than one pass (~35 s) away from the other's.

Short workload as in pd.py: --num-requests held-out ShareGPT prompts at --rate req/s (Poisson),
greedy, ignore_eos, --max-tokens each, streamed; a fresh set of prompts for every warm pass and every
cycle (all configs of a cycle get the same set). TPOT per request = (last token - first token) / (tokens - 1),
p50 per pass. Ratio per cycle: a spec config's TPOT p50 over non-spec PD's in the same cycle; median, min
and max. Outputs must equal non-spec PD's on the same set (lossless); D's free pages must be back to total.

  python -m evals.pd_interleaved --configs pd,pd_spec_decode_only,pd_spec_both --passes 6
        -> evals/results/pd_interleaved.json
"""
from __future__ import annotations

import argparse
import contextlib
import os
import random
import sys
import time

EVALS_DIR = os.path.dirname(os.path.abspath(__file__))
from evals.harness.prompts import held_out_prompt_sets
from evals.harness.results import command_line, log, machine_info, median, versions, write_json
from evals.harness.servers import transfer_backend
from evals.harness.client import run_workload, summarize
from evals.harness.servers import pd_cluster
from evals.pd_configs import add_cluster_args, cluster_configs

import httpx

RESULTS_DIR = os.path.join(EVALS_DIR, "results")
POLICY_KEYS = ("spec_rounds", "spec_rounds_off", "spec_rounds_narrow", "spec_draft_tokens_hist", "spec_policy")


def cpu_seconds(pids: list[int]) -> float:
    """User + system CPU seconds of these processes so far (/proc/PID/stat; 0 where it cannot be read)."""
    total = 0.0
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            total += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
        except (OSError, IndexError, ValueError):
            pass
    return total


def server_pids(urls: list[str]) -> list[int]:
    return [httpx.get(u + "/server_info").json().get("pid") for u in urls]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--configs", default="pd,pd_spec_decode_only,pd_spec_both",
                    help="pd.py's PD config names; the first is the reference (non-spec PD)")
    add_cluster_args(ap)
    ap.add_argument("--num-requests", type=int, default=16)
    ap.add_argument("--rate", type=float, default=0.5)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--warm", type=int, default=2, help="unmeasured passes per cluster before the first measured one")
    ap.add_argument("--passes", type=int, default=6, help="measured passes per config")
    ap.add_argument("--out", default=os.path.join(RESULTS_DIR, "pd_interleaved.json"))
    args = ap.parse_args()
    args.backend = transfer_backend(args.backend)
    names = args.configs.split(",")
    table = cluster_configs(args)
    if any(table[n][0] != "pd" for n in names):
        raise SystemExit("only PD configs (pd, pd_spec_both, pd_spec_decode_only, pd_normal_priority)")
    meta = {"versions": versions(), "machine": machine_info()}
    from specpd.model.loader import load_checkpoint
    # a set of prompts for each warm pass and each cycle, the same set for every config in a cycle
    sets = held_out_prompt_sets(load_checkpoint("default").tokenizer, [args.num_requests] * (args.warm + args.passes))
    rng = random.Random(0)
    delays, t = [], 0.0
    for _ in range(args.num_requests):
        delays.append(t)
        t += rng.expovariate(args.rate)
    t_start = time.perf_counter()
    passes: list[dict] = []
    with contextlib.ExitStack() as stack:
        urls = {}
        for n in names:  # one after another: a spec D's startup cost measurement runs on a quiet box
            log(f"== start {n}")
            urls[n] = stack.enter_context(pd_cluster(table[n][1], args.backend))
        pids = {n: server_pids(list(u[1:])) for n, u in urls.items()}
        for n in names:
            for w in range(args.warm):
                rows = run_workload(urls[n][0], sets[w], delays, args.max_tokens)
                assert all("error" not in r for r in rows), [r["error"] for r in rows if "error" in r][:3]
                log(f"   warm {n} {w}: TPOT p50 {summarize(rows)['tpot_p50_s'] * 1e3:.0f} ms")
        for cycle in range(args.passes):
            prompts, tokens_of = sets[args.warm + cycle], {}
            k = cycle % len(names)
            order = names[k:] + names[:k] if len(names) > 2 else (names if cycle % 2 == 0 else names[::-1])
            for n in order:
                others = [m for m in names if m != n]
                idle0 = cpu_seconds([p for m in others for p in pids[m]])
                own0 = cpu_seconds(pids[n])
                t0 = time.perf_counter()
                rows = run_workload(urls[n][0], prompts, delays, args.max_tokens)
                wall = time.perf_counter() - t0
                s = summarize(rows)
                tokens_of[n] = [r.get("tokens") for r in rows]
                passes.append({"cycle": cycle, "config": n, "tpot_p50_ms": s["tpot_p50_s"] * 1e3,
                               "tpot_p99_ms": s["tpot_p99_s"] * 1e3, "ttft_p50_ms": s["ttft_p50_s"] * 1e3,
                               "tau": s.get("tau"), "num_errors": s["num_errors"], "wall_s": wall,
                               "server_cpu_s": cpu_seconds(pids[n]) - own0,
                               "idle_clusters_cpu_s": cpu_seconds([p for m in others for p in pids[m]]) - idle0})
                p = passes[-1]
                log(f"   cycle {cycle} {n}: TPOT p50 {p['tpot_p50_ms']:.0f} ms  tau {p['tau'] or 1:.2f}  "
                    f"errors {p['num_errors']}  idle clusters {p['idle_clusters_cpu_s']:.1f} cpu-s")
            for p in passes[-len(names):]:  # lossless: the same tokens as the reference config, same prompts
                p["same_tokens_as_reference"] = tokens_of[p["config"]] == tokens_of[names[0]]
        finals = {}
        for n in names:
            d_info = httpx.get(urls[n][2] + "/server_info").json()
            finals[n] = {"pages_back_to_total": d_info.get("free_pages") == d_info.get("total_pages"),
                         "d_spec_policy": {k: d_info[k] for k in POLICY_KEYS if k in d_info}}
    ref = names[0]
    by_cycle = {c: {p["config"]: p for p in passes if p["cycle"] == c} for c in range(args.passes)}
    ratios = {}
    for n in names[1:]:
        per = [by_cycle[c][n]["tpot_p50_ms"] / by_cycle[c][ref]["tpot_p50_ms"] for c in range(args.passes)]
        ratios[f"{n}_over_{ref}_tpot_p50_by_cycle"] = {"median": median(per), "min": min(per), "max": max(per),
                                                        "cycles": per, "below_1": sum(r < 1 for r in per)}
    report = {"benchmark": "pd_interleaved", "description": __doc__.split("\n\n")[0],
              "command": command_line(), "backend": args.backend, "configs": names,
              "engine_args": {n: table[n][1] for n in names}, "num_requests": args.num_requests,
              "prompt_tokens_per_set": [[len(p) for p in ps] for ps in sets], "rate_req_per_s": args.rate,
              "max_tokens": args.max_tokens, "warm_passes": args.warm, "passes": passes, "ratios": ratios,
              "tpot_p50_ms_median": {n: median([p["tpot_p50_ms"] for p in passes if p["config"] == n]) for n in names},
              "lossless": all(p["same_tokens_as_reference"] for p in passes),
              "errors": sum(p["num_errors"] for p in passes), "final": finals,
              "bench_wall_s": round(time.perf_counter() - t_start, 1), **meta}
    write_json(args.out, report)
    for k, v in ratios.items():
        log(f"{k}: median {v['median']:.3f} [{v['min']:.3f}-{v['max']:.3f}], {v['below_1']}/{len(v['cycles'])} below 1")
    log(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
