"""Soak: a bounded mixed-load run through a 1P1D speculative cluster that this script starts itself.

  python -m evals.soak                  # 30 min of load -> evals/results/soak.json, evals/results/soak.png
  python -m evals.soak --minutes 8      # a short run

The cluster: `specpd serve --disagg 1p1d --model default --speculative-algorithm eagle3 --draft-model default`
(plus --serve-args) as a child process on free 127.0.0.1 ports, `--max-request-bytes` set small (1 MiB by
default) so oversized bodies stay cheap. Load, all through the router over HTTP, at most --max-inflight
requests at once (an arrival that finds the bound full waits for a slot; counted as `arrivals_waited`):
Poisson arrivals at --rate req/s, each request one of
  ok          /v1/completions, held-out ShareGPT first turn (chat template) or (--long-frac) a --long-len-token
              ShareGPT text; streamed (--stream-frac, with include_usage) or not; greedy or temperature 0.8;
              ignore_eos; must answer 200 (a stream: chunks then [DONE], no error event) -> completed / failed
  disconnect  (--disconnect-frac) a stream the client closes after 1-3 chunks: expected, pages must come back
  abort       (--abort-frac) a non-streamed request the client gives up on after 0.3-3 s: expected
  bad         (--bad-frac) a malformed request (negative max_tokens, wrong types, bad JSON, out-of-vocab id,
              missing prompt, ...): expected 400; any other answer is a failure
  oversize    (--oversize-frac) a body 1.25x --max-request-bytes: expected 413
A request with no answer at all within --lost-after s (the client's bound) is `lost`, not `failed`.
At the deadline arrivals stop; in-flight requests drain (each still bounded by --lost-after); then P's and
D's free pages are polled (read through the router's /server_info and from each server) for up to 30 s:
leaked = total - free at the end. RSS (VmRSS) of the launcher, P, D and router is sampled every 10 s;
growth is reported from the first sample after the warm-up (the first 20% of the load) to the last one.
TTFT / TPOT p50 / p90 / p99 over the streamed successes (TPOT: (last token chunk - first) / (tokens - 1)).
Then SIGINT to the launcher (SIGKILL to its process group after 30 s).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import sys
import tempfile
import time

EVALS_DIR = os.path.dirname(os.path.abspath(__file__))
from evals.harness.prompts import held_out_sharegpt_prompts, real_text_prompts
from evals.harness.results import command_line, log, machine_info, versions, write_json
from evals.soak_cluster import (RssSampler, pages_after_drain, roles_of, server_info, start_cluster, stop_cluster,
                                wait_ready)
from evals.soak_load import Load
from evals.soak_report import plot, summarize

RESULTS_DIR = os.path.join(EVALS_DIR, "results")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--minutes", type=float, default=30.0, help="load duration (then drain and stop)")
    ap.add_argument("--rate", type=float, default=0.3, help="Poisson arrival rate, requests/s")
    ap.add_argument("--max-inflight", type=int, default=16)
    ap.add_argument("--long-frac", type=float, default=0.15)
    ap.add_argument("--long-len", type=int, default=2000)
    ap.add_argument("--stream-frac", type=float, default=0.5)
    ap.add_argument("--disconnect-frac", type=float, default=0.05)
    ap.add_argument("--abort-frac", type=float, default=0.03)
    ap.add_argument("--bad-frac", type=float, default=0.04)
    ap.add_argument("--oversize-frac", type=float, default=0.02)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--max-tokens-long", type=int, default=32)
    ap.add_argument("--max-request-bytes", type=int, default=1 << 20, help="passed to the cluster")
    ap.add_argument("--lost-after", type=float, default=300.0, help="no answer within this: lost")
    ap.add_argument("--serve-args", default="", help="extra flags for `specpd serve --disagg`")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=os.path.join(RESULTS_DIR, "soak.json"))
    ap.add_argument("--png", default=os.path.join(RESULTS_DIR, "soak.png"))
    args = ap.parse_args()

    from specpd.model.loader import load_checkpoint
    tokenizer = load_checkpoint("default").tokenizer
    vocab = tokenizer.vocab_size() if callable(tokenizer.vocab_size) else tokenizer.vocab_size
    short = held_out_sharegpt_prompts(tokenizer, 400)
    log_file = tempfile.NamedTemporaryFile("w+", prefix="specpd-soak-", suffix=".log", delete=False)
    t_boot = time.monotonic()
    proc, cmd, urls = start_cluster(args, log_file)
    results = {"command": command_line(),
               "cluster_command": " ".join(["specpd", *cmd[cmd.index("serve"):]]), "args": vars(args),
               "machine": machine_info(), "versions": versions()}
    code = 1
    try:
        wait_ready(proc, urls["router"], 900)
        results["cluster_up_s"] = round(time.monotonic() - t_boot, 1)
        log(f"cluster up in {results['cluster_up_s']} s: {urls}")
        p_info = server_info(urls["prefill"]) or {}
        max_len = p_info.get("max_model_len") or 4096
        long_len = min(args.long_len, max_len - args.max_tokens_long - 8)
        long, source = real_text_prompts(tokenizer, 40, long_len)
        results.update(long_len=long_len, long_prompt_source=source, max_model_len=max_len,
                       transfer_backend=p_info.get("transfer_backend"),
                       pages_at_start={r: {k: (server_info(urls[r]) or {}).get(k) for k in ("free_pages", "total_pages")}
                                       for r in ("prefill", "decode")})
        load_s = args.minutes * 60
        t0 = time.monotonic()
        results["load_start_utc"] = time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime())
        rss = RssSampler(proc.pid, t0)
        rss.start()
        load = Load(args, urls["router"], short, long, vocab, t0)
        run_info = asyncio.run(load.run(load_s))
        results["run"] = run_info
        results["drained_utc"] = time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime())
        results["pages_after_drain"] = pages_after_drain(urls)
        rss.stop()
        results["cluster_pids"] = roles_of(proc.pid)
        warmup_t = 0.2 * load_s
        results["rss"] = rss.summary(warmup_t)
        results["rss_samples"] = rss.samples
        results["summary"] = summarize(load.records)
        results["records"] = load.records
        s = results["summary"]
        code = 0 if (s["failed"] == 0 and s["lost"] == 0
                     and all(p["leaked_pages"] == 0 for p in results["pages_after_drain"].values())) else 1
        os.makedirs(os.path.dirname(args.png), exist_ok=True)
        plot(args.png, rss.samples, load.records, warmup_t, run_info["load_end_s"])
    finally:
        results["shutdown_start_utc"] = time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime())
        results["shutdown"] = stop_cluster(proc)
        log_file.flush()
        with open(log_file.name) as f:
            text = f.read()
        results["cluster_log_tail"] = text[-8000:]
        # every timestamped WARNING/ERROR line of the whole run, to place them against the load's wall clock
        results["cluster_log_problems"] = {
            "count_task_exception_never_retrieved": text.count("Task exception was never retrieved"),
            "count_traceback": text.count("Traceback (most recent call last)"),
            "lines": re.findall(r"^\d{4}-\d\d-\d\d [\d:,]+ (?:WARNING|ERROR|CRITICAL) .*$", text, re.M)[:200]}
        log_file.close()
        os.unlink(log_file.name)
        write_json(args.out, results)
        log(f"wrote {args.out}")
    s = results.get("summary", {})
    log(json.dumps({k: s.get(k) for k in ("sent", "completed", "expected_refusals", "failed", "lost",
                                          "failed_by_reason", "ttft_s", "tpot_s")}))
    log(json.dumps({"pages_after_drain": results.get("pages_after_drain"),
                    "rss_growth_pct": {r: v.get("growth_after_warmup_pct") for r, v in results.get("rss", {}).items()},
                    "shutdown": results["shutdown"]}))
    return code


if __name__ == "__main__":
    sys.exit(main())
