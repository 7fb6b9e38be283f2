"""Does the decode server speculate when the unified server would, start after start? (issue 31)

Each config is exactly what a user types, started fresh for every restart (the order rotates per restart):
  pd_both         specpd serve --disagg 1p1d --model default --speculative-algorithm eagle3 --draft-model default
                  --draft-mode both
  pd_decode_only  the same with --draft-mode decode-only
  unified         specpd serve --model default --speculative-algorithm eagle3 --draft-model default (every usable
                  core: its own threads)
  unified_d_threads  the same with --num-threads N, N = the threads the launcher gives D (split_cores; one on a
                  2-core box): the same engine as D, so the same costs
Workload: --num-prompts held-out ShareGPT chat prompts (first human turn, chat template), --max-tokens greedy tokens
each, one request at a time. Per run: D's (or the unified server's) depth-0 share of request-rounds, tau, probes, the
verify count of every request, the calibrated cost table (clock, 1..16 rows) and online scales, the box's load.
Summary per config: the share's min / max over restarts, and each PD config's share and tau against both unified
configs', restart by restart.

  python -m evals.pd_spec_repeat --restarts 3     # -> evals/results/pd_spec_repeat.json
"""
from __future__ import annotations

import argparse
import os
import sys
import time

EVALS_DIR = os.path.dirname(os.path.abspath(__file__))
from evals.harness.prompts import held_out_prompt_sets
from evals.harness.results import command_line, log, machine_info, versions, write_json

import httpx

from specpd.machine import split_cores, usable_cores
from specpd.server.launch import free_port, serve_processes

SPEC = ["--model", "default", "--speculative-algorithm", "eagle3", "--draft-model", "default"]


def configs() -> dict[str, list[str]]:
    d_threads = split_cores(usable_cores(), 1, 1)[1][0]
    return {"pd_both": ["--disagg", "1p1d", *SPEC, "--draft-mode", "both"],
            "pd_decode_only": ["--disagg", "1p1d", *SPEC, "--draft-mode", "decode-only"],
            "unified": SPEC, "unified_d_threads": [*SPEC, "--num-threads", str(d_threads)]}


def run(name: str, args: list[str], prompts: list[list[int]], max_tokens: int) -> dict:
    d_port = free_port()
    if args[0] == "--disagg":
        args = [*args, "--prefill-port", str(free_port()), "--decode-port", str(d_port), "--bootstrap-port",
                str(free_port())]
    load_at_start = os.getloadavg()
    with serve_processes([["--log-level", "warning", *args]], 900, env={"MC_LOG_LEVEL": "ERROR"}) as [(_, base, _)]:
        server = f"http://127.0.0.1:{d_port}" if args[0] == "--disagg" else base
        usages, t0 = [], time.perf_counter()
        with httpx.Client(base_url=base, timeout=900) as client:
            for prompt in prompts:
                body = client.post("/v1/completions", json={"prompt": prompt, "max_tokens": max_tokens,
                                                            "temperature": 0}).json()
                usages.append(body["usage"])
        wall = time.perf_counter() - t0
        info = httpx.get(server + "/server_info").json()
    policy = info.get("spec_policy") or {}
    cost = policy.get("cost_model") or {}
    rows = ("1", "2", "3", "4", "6", "8", "16")
    out = {"config": name, "command": ["specpd", "serve", *args], "load_avg_start": load_at_start,
           "load_avg_end": os.getloadavg(), "wall_s": wall, "threads": (info.get("runtime") or {}).get("num_threads"),
           "rounds_off_share": info.get("spec_rounds_off_share"), "rounds": info.get("spec_rounds"),
           "tau": info.get("spec_accept_length"), "probes": info.get("spec_probes"),
           "verify_counts": [u.get("spec_verify_count") for u in usages],
           "accept": policy.get("accept"), "cost_clock": cost.get("clock"),
           "cost_target_ms": {r: cost["target_rows"][r] * 1e3 for r in rows if r in (cost.get("target_rows") or {})},
           "cost_draft_ms": {r: v * 1e3 for r, v in (cost.get("draft_rows") or {}).items()},
           "cost_scale": cost.get("scale"), "draft_scale": cost.get("draft_scale"),
           "usage_has_acceptance": all("spec_verify_count" in u and "spec_accept_length" in u for u in usages)}
    log(f"   {name}: share {out['rounds_off_share']}, tau {out['tau']}, verifies {out['verify_counts']}, "
        f"T(1) {out['cost_target_ms'].get('1')} ms ({out['cost_clock']}), load {load_at_start[0]:.1f}")
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--restarts", type=int, default=3)
    ap.add_argument("--num-prompts", type=int, default=5)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--configs", default="pd_both,pd_decode_only,unified,unified_d_threads")
    ap.add_argument("--out", default=os.path.join(EVALS_DIR, "results", "pd_spec_repeat.json"))
    args = ap.parse_args()
    meta = {"versions": versions(), "machine": machine_info()}
    from specpd.model.loader import load_checkpoint
    [prompts] = held_out_prompt_sets(load_checkpoint("default").tokenizer, [args.num_prompts])
    names, table = args.configs.split(","), configs()
    runs = []
    for restart in range(args.restarts):
        order = names[restart % len(names):] + names[:restart % len(names)]  # rotates: drift falls on all alike
        log(f"== restart {restart + 1}: {order}")
        for name in order:
            runs.append({"restart": restart + 1, **run(name, table[name], prompts, args.max_tokens)})
    summary = {}
    for name in names:
        mine = [r for r in runs if r["config"] == name]
        shares = [r["rounds_off_share"] for r in mine if r["rounds_off_share"] is not None]
        summary[name] = {"shares": [r["rounds_off_share"] for r in mine], "taus": [r["tau"] for r in mine],
                         "share_spread": max(shares) - min(shares) if shares else None}
        if name.startswith("pd"):
            for ref in ("unified", "unified_d_threads"):
                pairs = [(r, u) for r in mine for u in runs if u["config"] == ref and u["restart"] == r["restart"]]
                summary[name][f"share_minus_{ref}"] = [r["rounds_off_share"] - u["rounds_off_share"] for r, u in pairs
                                                       if None not in (r["rounds_off_share"], u["rounds_off_share"])]
                summary[name][f"tau_over_{ref}"] = [r["tau"] / u["tau"] for r, u in pairs if r["tau"] and u["tau"]]
    write_json(args.out, {"benchmark": "pd_spec_repeat", "description": __doc__.split("\n\n")[0],
                          "command": command_line(), "num_prompts": len(prompts),
                          "prompt_tokens": [len(p) for p in prompts], "max_tokens": args.max_tokens,
                          "summary": summary, "runs": runs, **meta})
    log(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
