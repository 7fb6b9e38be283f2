"""1P1D vs unified serving on the default model: TTFT/TPOT, long-prompt interference, KV transfer, tau.

Servers are real `specpd serve` processes on 127.0.0.1. PD: prefill pinned to core 0 and decode to core 1
(`taskset`, one torch thread each) behind the router; unified: one process with two torch threads on both
cores. Configurations (each a fresh set of servers): unified and PD, non-speculative and speculative
(`--speculative-algorithm ALG --draft-model DRAFT`), PD in both draft modes. Every server runs with
`--engine-priority low` (--engine-priority), and `pd_normal_priority` repeats non-spec 1P1D at normal
priority: on a core the engine owns, a KV write otherwise waits for the scheduler at each round trip.

Workloads, greedy, ignore_eos (every request generates --max-tokens tokens), streamed (usage included):
  short  N held-out ShareGPT prompts (first human turn, chat template), Poisson arrivals at --rate req/s
  mixed  N more such prompts plus --num-long prompts of --long-len tokens (ShareGPT text) arriving among them; the
         figure of merit is the short requests' TPOT p99 (prefill of a long prompt stalls unified decode)
  TTFT = first streamed token - send; TPOT = (last token - first token) / (tokens - 1), per request.
KV transfer: the prefill server's counters (bytes, seconds inside the transfer backend, descriptors) give
the achieved MB/s, set against a raw Mooncake TransferEngine moving the same pages (one descriptor per
page, same page size, same number of pages per call) between two engines of this process, in the same run
(3 passes; best and median): for the short workload's 16 requests (kv_short) and for every request of the
run, short then mixed (kv_all: 34 requests, the larger sample).
tau: committed tokens per verify forward from the usage of every request; PD / unified per mode.
TTFT breakdown (PD configs): the router's, P's and D's stage durations (specpd/disagg/timeline.py), each on its
own server's clock, per workload: mean over the workload's requests, p50 / p99 over each server's recent window.

  python -m evals.pd --draft-model default --algorithm eagle3    # -> evals/results/pd.json
  python -m evals.pd --quick --draft-model DIR                   # smoke -> $TMPDIR
  python -m evals.pd --configs pd,pd_spec_both,pd_spec_decode_only --rounds 4   # spec vs non-spec TPOT:
        the configs 4 times in ABBA order, each spec config's TPOT over non-spec's round by round (the box
        moves PD figures 25-100% within minutes; one config after another cannot settle a 10% difference)
        (add --warm-pass: each fresh cluster runs the short workload once before it is measured)
  python -m evals.pd --serve-defaults --configs pd,pd_spec_both,pd_spec_decode_only --rounds 3 --warm-pass
        # -> evals/results/pd_serve_defaults.json: what `make serve` runs, nothing else: every PD config is
        `specpd serve --disagg 1p1d --model default [--speculative-algorithm eagle3 --draft-model default
        --draft-mode MODE]` (the launcher splits the cores, no pinning, normal priority, default pages);
        unified configs `specpd serve --model default [same spec flags]`. Each round restarts every cluster.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile
import time

EVALS_DIR = os.path.dirname(os.path.abspath(__file__))
from evals.harness.prompts import held_out_prompt_sets, real_text_prompts
from evals.harness.results import command_line, log, machine_info, median, versions, write_json
from evals.harness.servers import transfer_backend
from evals.harness.client import kv_delta, log_breakdown, run_workload, stage_breakdown, stage_snapshot, summarize
from evals.harness.servers import launcher_cluster, pd_cluster, unified_cluster
from evals.pd_configs import add_cluster_args, cluster_configs

import httpx

RESULTS_DIR = os.path.join(EVALS_DIR, "results")


# -- raw Mooncake ------------------------------------------------------------------------------------
def raw_mooncake(page_bytes: int, pages_per_request: list[int], per_call: int = 512, reps: int = 3) -> dict | None:
    """The same pages through two bare TransferEngines of this process (loopback TCP)."""
    try:
        import torch

        from specpd.disagg.transfer.mooncake import load_transfer_engine
        engine_cls = load_transfer_engine()
    except ImportError as e:
        return {"skipped": str(e)}
    max_pages = max(pages_per_request)
    src_buf = torch.randn(max_pages * page_bytes // 4 + 1)
    dst_buf = torch.zeros_like(src_buf)
    engines = []
    for buf in (src_buf, dst_buf):
        eng = engine_cls()
        assert eng.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0
        assert eng.register_memory(buf.data_ptr(), buf.numel() * 4) == 0
        engines.append(eng)
    src, dst = engines
    peer = f"127.0.0.1:{dst.get_rpc_port()}"
    per_rep = []
    for _ in range(reps):
        total_bytes, total_s = 0, 0.0
        for n in pages_per_request:
            addrs = [i * page_bytes for i in range(n)]
            for i in range(0, n, per_call):
                chunk = addrs[i:i + per_call]
                t0 = time.perf_counter()
                rc = src.batch_transfer_sync_write(peer, [src_buf.data_ptr() + a for a in chunk],
                                                   [dst_buf.data_ptr() + a for a in chunk], [page_bytes] * len(chunk))
                total_s += time.perf_counter() - t0
                assert rc == 0, rc
                total_bytes += page_bytes * len(chunk)
        per_rep.append(total_bytes / total_s / 1e6)
    assert torch.equal(src_buf[: max_pages * page_bytes // 4], dst_buf[: max_pages * page_bytes // 4])
    return {"mb_per_s_best_of_reps": max(per_rep), "mb_per_s_median_of_reps": sorted(per_rep)[len(per_rep) // 2],
            "mb_per_s_per_rep": per_rep, "reps": reps, "bytes_per_rep": total_bytes, "page_bytes": page_bytes}


# -- main --------------------------------------------------------------------------------------------
def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_cluster_args(ap)
    ap.add_argument("--num-requests", type=int, default=16)
    ap.add_argument("--rate", type=float, default=0.5, help="Poisson arrivals, requests per second")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--num-long", type=int, default=2)
    ap.add_argument("--long-len", type=int, default=2000)
    ap.add_argument("--configs", default="unified,unified_spec,pd,pd_spec_both,pd_spec_decode_only,pd_normal_priority")
    ap.add_argument("--rounds", type=int, default=1,
                    help="run the configs this many times, the order reversed every other round (ABBA); "
                         "`results` keeps the first round in full, `rounds` every round's TPOT")
    ap.add_argument("--warm-pass", action="store_true",
                    help="run the short workload once on each fresh cluster before measuring (its first pass "
                         "reads slower for every config: non-spec 160, 128, 72 ms in three passes in a row)")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if args.quick:
        args.num_requests, args.max_tokens, args.num_long, args.long_len = 4, 8, 1, 600
    out_path = args.out or (os.path.join(tempfile.gettempdir(), "specpd_pd_quick.json") if args.quick
                            else os.path.join(RESULTS_DIR, "pd_serve_defaults.json" if args.serve_defaults
                                              else "pd.json"))
    args.backend = transfer_backend(args.backend)
    meta = {"versions": versions(), "machine": machine_info()}
    from specpd.model.loader import load_checkpoint
    tok = load_checkpoint("default").tokenizer
    # prompts of their own for the first requests, the warm pass, the measured short pass and the mixed pass
    short, warm_short, mixed_short, first = held_out_prompt_sets(tok, [args.num_requests] * 3 + [2])
    long_prompts, _ = real_text_prompts(tok, args.num_long, args.long_len)
    rng = random.Random(0)
    delays, t = [], 0.0
    for _ in short:
        delays.append(t)
        t += rng.expovariate(args.rate)
    # the long prompts arrive a third and two thirds into the short stream
    long_delays = [delays[len(delays) * (i + 1) // (args.num_long + 1)] + 0.01 for i in range(args.num_long)]
    mixed_prompts, mixed_delays = mixed_short + long_prompts, delays + long_delays
    short_idx = list(range(len(mixed_short)))

    configs = cluster_configs(args)

    def run_config(name: str):
        kind, engine_args = configs[name]
        log(f"== {name}")
        if args.serve_defaults:
            cm = unified_cluster(engine_args, True) if kind == "unified" else launcher_cluster(engine_args)
        else:
            cm = unified_cluster(engine_args) if kind == "unified" else pd_cluster(engine_args, args.backend,
                                                                                   args.prefill_tp, args.decode_tp)
        with cm as urls:
            url = urls[0]
            warm = run_workload(url, first, [0, 0], 4)  # first-request costs out of the measurement
            assert all("error" not in r for r in warm), warm
            if args.warm_pass:  # a fresh cluster's first pass runs slower for every config: measure the next one
                warm = run_workload(url, warm_short, delays, args.max_tokens)
                assert all("error" not in r for r in warm), warm
            p_url = urls[1] if kind == "pd" else None
            before = httpx.get(p_url + "/server_info").json() if p_url else {}
            d_before = httpx.get((urls[2] if p_url else url) + "/server_info").json()
            stages0 = stage_snapshot(urls) if p_url else {}
            rows_short = run_workload(url, short, delays, args.max_tokens)
            mid = httpx.get(p_url + "/server_info").json() if p_url else {}
            stages1 = stage_snapshot(urls) if p_url else {}
            d_short = httpx.get((urls[2] if p_url else url) + "/server_info").json()  # D's policy over the short pass
            rows_mixed = run_workload(url, mixed_prompts, mixed_delays, args.max_tokens)
            after = httpx.get(p_url + "/server_info").json() if p_url else {}
            stages2 = stage_snapshot(urls) if p_url else {}
            d_info = httpx.get(urls[2] + "/server_info").json() if p_url else httpx.get(url + "/server_info").json()
        entry = {"short": summarize(rows_short), "mixed_all": summarize(rows_mixed),
                 "mixed_short_only": summarize(rows_mixed, short_idx),
                 "mixed_long_only": summarize(rows_mixed, list(range(len(mixed_short), len(mixed_prompts))))}
        if p_url:
            entry["kv_short"], entry["kv_mixed"] = kv_delta(before, mid), kv_delta(mid, after)
            entry["kv_all"] = kv_delta(before, after)
            entry["kv_pages_per_request_short"] = [-(-len(p) // 16) for p in short]
            entry["ttft_breakdown_short"] = stage_breakdown(stages0, stages1)
            entry["ttft_breakdown_mixed"] = stage_breakdown(stages1, stages2)
        entry["pages_back_to_total"] = d_info.get("free_pages") == d_info.get("total_pages")
        # what D's adaptive policy chose over the run (rounds off / narrow, its learned costs and acceptance)
        entry["d_spec_policy"] = {k: d_info[k] for k in ("spec_rounds", "spec_rounds_off", "spec_rounds_narrow",
                                                         "spec_draft_tokens_hist", "spec_policy") if k in d_info}
        entry["d_runtime"] = d_info.get("runtime")
        if "spec_rounds" in d_short:  # the depth-0 share of D's request-rounds in the measured (short) pass alone
            rounds = d_short["spec_rounds"] - d_before.get("spec_rounds", 0)
            off = d_short["spec_rounds_off"] - d_before.get("spec_rounds_off", 0)
            entry["d_short_rounds_off_share"] = off / rounds if rounds else None
        s, m = entry["short"], entry["mixed_short_only"]
        log(f"   short: TTFT p50 {s['ttft_p50_s']:.2f} p99 {s['ttft_p99_s']:.2f}  TPOT p50 {s['tpot_p50_s'] * 1e3:.0f} ms "
            f"p99 {s['tpot_p99_s'] * 1e3:.0f} ms  tau {s.get('tau', 1):.2f}  errors {s['num_errors']}")
        log(f"   mixed (short requests): TPOT p99 {m['tpot_p99_s'] * 1e3:.0f} ms  TTFT p99 {m['ttft_p99_s']:.2f}")
        if p_url:
            log(f"   kv: {entry['kv_short']['mb_per_s']} MB/s, {entry['kv_short']['descriptors_per_request']} desc/req")
            log_breakdown("short", entry["ttft_breakdown_short"])
            log_breakdown("mixed", entry["ttft_breakdown_mixed"])
        return entry, [r.get("tokens") for r in rows_short + rows_mixed]

    results, outputs, rounds = {}, {}, []
    t_start = time.perf_counter()
    order = args.configs.split(",")
    for rnd in range(args.rounds):
        rounds.append({})
        for name in (order if rnd % 2 == 0 else order[::-1]):  # ABBA: drift falls on every config alike
            entry, outs = run_config(name)
            results.setdefault(name, entry)  # the first round's, in full
            outputs.setdefault(name, outs)
            rounds[-1][name] = {"short_tpot_p50_ms": entry["short"]["tpot_p50_s"] * 1e3,
                                "tau": entry["short"].get("tau"),
                                "d_short_rounds_off_share": entry.get("d_short_rounds_off_share"),
                                "load_avg": os.getloadavg(),
                                "mixed_short_tpot_p99_ms": entry["mixed_short_only"]["tpot_p99_s"] * 1e3,
                                "d_spec_policy": entry.get("d_spec_policy")}
    ratios = {}
    if "pd" in order and args.rounds > 1:  # each spec config's short TPOT p50 over non-spec PD's, round by round
        for n in order:
            if n.startswith("pd_spec"):
                per = [r[n]["short_tpot_p50_ms"] / r["pd"]["short_tpot_p50_ms"] for r in rounds]
                ratios[f"{n}_over_pd_short_tpot_p50_by_round"] = {"median": median(per), "min": min(per),
                                                                   "max": max(per), "rounds": per}
    for pd_name, uni_name in (("pd", "unified"), ("pd_spec_both", "unified_spec"), ("pd_spec_decode_only", "unified_spec")):
        if pd_name in results and uni_name in results:
            pd_r, uni = results[pd_name], results[uni_name]
            ratios[f"{pd_name}_over_{uni_name}"] = {
                "mixed_short_tpot_p99": pd_r["mixed_short_only"]["tpot_p99_s"] / uni["mixed_short_only"]["tpot_p99_s"],
                "short_tpot_p50": pd_r["short"]["tpot_p50_s"] / uni["short"]["tpot_p50_s"],
                "short_ttft_p50": pd_r["short"]["ttft_p50_s"] / uni["short"]["ttft_p50_s"],
                "tau": (pd_r["short"]["tau"] / uni["short"]["tau"]) if "tau" in uni["short"] else None,
                "tau_mixed": (pd_r["mixed_all"]["tau"] / uni["mixed_all"]["tau"]) if "tau" in uni["mixed_all"] else None,
                "same_tokens": outputs[pd_name] == outputs[uni_name]}
    raw = None
    pd_names = [n for n in results if n.startswith("pd")]
    if args.backend == "mooncake" and pd_names:
        kv = results[pd_names[0]]["kv_short"]
        page_bytes = int(kv["kv_bytes"] / max(1, kv["kv_descriptors"]))  # target-only configs: one pool
        pages = {"kv_short": [-(-len(p) // 16) for p in short]}
        pages["kv_all"] = pages["kv_short"] + [-(-len(p) // 16) for p in mixed_prompts]  # short run, then mixed
        raw = {key: raw_mooncake(page_bytes, pp) for key, pp in pages.items()}
        for n in pd_names:
            for key, r in raw.items():
                mbps = results[n][key]["mb_per_s"]
                if r and r.get("mb_per_s_best_of_reps") and mbps:
                    results[n][key]["over_raw_mooncake"] = mbps / r["mb_per_s_best_of_reps"]
                    results[n][key]["over_raw_mooncake_median"] = mbps / r["mb_per_s_median_of_reps"]
    report = {"benchmark": "pd", "description": __doc__.split("\n\n")[0], "command": command_line(),
              "backend": args.backend, "model": "default (SmolLM2-135M-Instruct)", "draft_model": args.draft_model,
              "algorithm": args.algorithm, "spec_steps": args.spec_steps, "num_short": len(short),
              "short_prompt_tokens": [len(p) for p in short], "num_long": args.num_long, "long_len": args.long_len,
              "rate_req_per_s": args.rate, "max_tokens": args.max_tokens,
              "engine_priority": None if args.serve_defaults else args.engine_priority,
              "serve_defaults": args.serve_defaults, "warm_pass": args.warm_pass, "arrival_s": delays,
              "long_arrival_s": long_delays, "results": results, "rounds": rounds, "ratios": ratios,
              "raw_mooncake": raw,
              "bench_wall_s": round(time.perf_counter() - t_start, 1), **meta}
    write_json(out_path, report)
    log(json.dumps(ratios, indent=1))
    log(f"wrote {out_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
