"""Acceptance across P/D tensor-parallel sizes: every pair x draft mode x draft shape against unified TP 1.

`python -m evals.tp_matrix [--pairs 1:1,1:3,3:1,3:3] [--max-tokens 32]` -> evals/results/tp_matrix.json
The default model with the shipped EAGLE-3 head, the pinned policy (`--spec-adaptive-pinned`: the same rounds
whatever the timings), greedy, fp32 (exact comparisons; bf16 TP sums round otherwise than TP 1's GEMM), KV over
tcp. For each draft shape (a chain of 3, and the default hybrid tree) the unified TP 1 engine answers the
prompts first; then for each P:D pair and draft mode (both, decode-only) real P, D and router processes answer
the same prompts. Recorded per case: whether every text equals unified's, and every request's (verify rounds,
accepted tokens) against unified's, so tau under PD at any TP pair is TP 1's exactly or the row says where not.
tests/disagg/test_pd_tp.py runs a few of these cases in `make test`; this runs them all (minutes).
"""
from __future__ import annotations

import argparse
import os
import time

import httpx

from evals.harness.results import command_line, log, machine_info, versions, write_json
from evals.harness.servers import launch

from specpd.server.launch import free_port

QUESTIONS = ["What is the capital of France, and what is it known for?",
             "Write a Python function that returns the n-th Fibonacci number.",
             "Write a SQL query that counts the rows of a table named users."]
SHAPES = {"chain3": ["--spec-num-steps", "3", "--spec-topk", "1"], "tree_default": []}


def ask_all(url: str, max_tokens: int) -> list[tuple[str, int, int]]:
    out = []
    for q in QUESTIONS:
        resp = httpx.post(url + "/v1/chat/completions", timeout=600, json={
            "messages": [{"role": "user", "content": q}], "max_tokens": max_tokens, "temperature": 0})
        resp.raise_for_status()
        body = resp.json()
        out.append((body["choices"][0]["message"]["content"], body["usage"]["spec_verify_count"],
                    body["usage"]["spec_accepted_tokens"]))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--pairs", default="1:1,1:3,3:1,3:3")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results",
                                                  "tp_matrix.json"))
    args = ap.parse_args()
    info = {"machine": machine_info(), "versions": versions(), "command": command_line()}
    pairs = [tuple(int(x) for x in p.split(":")) for p in args.pairs.split(",")]
    os.environ["SPECPD_AUTO_DTYPE"] = "float32"  # the servers inherit it: --dtype auto means fp32 here
    base = ["--model", "default", "--num-threads", "1", "--speculative-algorithm", "eagle3", "--draft-model",
            "default", "--spec-adaptive-pinned"]
    cases = []
    for shape, shape_flags in SHAPES.items():
        with launch([(["--role", "unified", *base, *shape_flags], None)]) as (url,):
            want = ask_all(url, args.max_tokens)
        log(f"{shape}: unified tau {1 + sum(a for _, _, a in want) / max(1, sum(v for _, v, _ in want)):.2f}")
        for mode in ("both", "decode-only"):
            for p_tp, d_tp in pairs:
                t0 = time.monotonic()
                boot = free_port()
                flags = [*base, *shape_flags, "--draft-mode", mode, "--transfer-backend", "tcp"]
                with launch([(["--role", "prefill", "--bootstrap-port", str(boot), "--tp-size", str(p_tp), *flags],
                              None), (["--role", "decode", "--tp-size", str(d_tp), *flags], None)]) as (p, d):
                    with launch([(["--role", "router", "--prefill", p, "--decode", d, "--bootstrap-port",
                                   str(boot)], None)]) as (router,):
                        got = ask_all(router, args.max_tokens)
                case = {"shape": shape, "draft_mode": mode, "prefill_tp": p_tp, "decode_tp": d_tp,
                        "text_equal": [g[0] == w[0] for g, w in zip(got, want)],
                        "rounds_accepted": [list(g[1:]) for g in got],
                        "unified_rounds_accepted": [list(w[1:]) for w in want],
                        "seconds": round(time.monotonic() - t0, 1)}
                case["tau_equal"] = case["rounds_accepted"] == case["unified_rounds_accepted"]
                cases.append(case)
                log(f"{shape} {mode} P tp{p_tp} -> D tp{d_tp}: text equal {all(case['text_equal'])}, "
                    f"rounds/accepted equal {case['tau_equal']} ({case['seconds']} s)")
    info.update(max_tokens=args.max_tokens, questions=QUESTIONS, cases=cases,
                all_equal=all(c["tau_equal"] and all(c["text_equal"]) for c in cases))
    write_json(args.out, info)
    log(f"all equal: {info['all_equal']} ({len(cases)} cases) -> {args.out}")


if __name__ == "__main__":
    main()
