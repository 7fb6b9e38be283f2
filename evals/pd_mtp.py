"""A DeepSeek-V3-shaped MoE with its own MTP layer (MLA, routed + shared experts, ~300M parameters, random; built
by evals/pd_mtp_model.py so that its MTP layer accepts) served by `specpd serve --speculative-algorithm mtp` with no
--draft-model: a 1P1D cluster in both draft modes against the unified server, τ, TTFT and TPOT.

Configurations (each a fresh set of real `specpd serve` processes on 127.0.0.1, bf16 where the CPU computes it; every
server one torch thread pinned to a core, so a unified server computes as fast as D and prefills as fast as P:
PD's costs show at equal compute, and a box shared with other work disturbs every config alike):
  unified_plain  one server, no speculation, core 1
  unified_mtp    one server, the checkpoint's MTP layer: MTP's default tree shape at full depth every round
                 (--no-spec-adaptive: τ over every round; the policy as served would decode plainly where a round does
                 not pay, and on this model a MoE verify over a tree's rows reads several experts a row), the head
                 alone (--no-spec-ngram), core 1
  pd_both / pd_decode_only  1P1D with the same flags and --draft-mode both / decode-only: P on core 0, D on core
                 1, one thread each (evals/pd_configs.py), KV over --backend
Workload: --num-prompts prompts of --prompt-len random token ids, greedy, --max-tokens each, one request at a time
(c1), streamed; TTFT = first streamed token - send, TPOT = (last - first) / (tokens - 1) per request, τ = tokens
committed per verify forward from every response's usage. --rounds rounds, each config once a round (fresh servers,
the order reversed every other round); a config's figures are its round with the lowest TPOT p50 (the least
disturbed: the box is shared), every round's p50s kept beside them. Every config's tokens are checked against
unified_plain's (speculation is lossless; a mismatch is recorded, not hidden).

  python -m evals.pd_mtp                      # -> evals/results/pd_mtp.json
  python -m evals.pd_mtp --quick              # smoke -> $TMPDIR
"""
from __future__ import annotations

import argparse
import datetime
import os
import random
import tempfile

EVALS_DIR = os.path.dirname(os.path.abspath(__file__))
from evals.harness.results import command_line, log, machine_info, versions, write_json
from evals.harness.servers import transfer_backend
from evals.pd_mtp_model import build
from evals.harness.client import kv_delta, run_workload, summarize
from evals.harness.servers import launch, pd_cluster

import httpx

RESULTS = os.path.join(EVALS_DIR, "results", "pd_mtp.json")


def configs(model_dir: str, args) -> dict[str, tuple[str, list[str]]]:
    base = ["--model", model_dir, "--page-size", "16", "--kv-cache-memory-mb", str(args.kv_mb)]
    spec = ["--speculative-algorithm", "mtp", "--no-spec-ngram", "--no-spec-adaptive", *args.spec_extra.split()]
    return {"unified_plain": ("unified", base), "unified_mtp": ("unified", base + spec),
            "pd_both": ("pd", base + spec + ["--draft-mode", "both"]),
            "pd_decode_only": ("pd", base + spec + ["--draft-mode", "decode-only"])}


def run_config(kind: str, engine_args: list[str], prompts: list[list[int]], args) -> dict:
    ctx = (launch([(["--role", "unified", "--num-threads", "1", *engine_args], "1")]) if kind == "unified"
           else pd_cluster(engine_args, transfer_backend(args.backend)))
    with ctx as urls:
        url = urls[0]
        p_url = urls[1] if kind == "pd" else None
        for prompt in prompts[:args.warmup]:  # first-request costs (page faults, the first prefill's allocations)
            run_workload(url, [prompt], [0.0], args.max_tokens)
        before = httpx.get(p_url + "/server_info").json() if p_url else None
        rows = [run_workload(url, [p], [0.0], args.max_tokens)[0] for p in prompts]  # c1: one at a time
        out = summarize(rows)
        if p_url:
            out["kv_transfer"] = kv_delta(before, httpx.get(p_url + "/server_info").json())
        info = httpx.get((urls[2] if kind == "pd" else url) + "/server_info").json()
        out["spec_rounds_off_share"] = info.get("spec_rounds_off_share")
        out["tokens"] = [r.get("tokens") for r in rows]
        return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model-dir", default=os.path.join(tempfile.gettempdir(), "specpd-bench-mtp-deepseek"),
                    help="where the checkpoint is built (reused when built with the same settings)")
    ap.add_argument("--damp", type=float, default=0.3, help="evals/pd_mtp_model.py: the layers' mixing scale")
    ap.add_argument("--num-prompts", type=int, default=12)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--kv-mb", type=int, default=256)
    ap.add_argument("--backend", default="mooncake", choices=("mooncake", "tcp"))
    ap.add_argument("--spec-extra", default="", help="more spec flags for the MTP configs")
    ap.add_argument("--configs", default="unified_plain,unified_mtp,pd_both,pd_decode_only")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--quick", action="store_true", help="4 prompts of 32 tokens, 16 new tokens; -> $TMPDIR")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if args.quick:
        args.num_prompts, args.prompt_len, args.max_tokens, args.warmup, args.rounds = 4, 32, 16, 1, 1
    out = args.out or (os.path.join(tempfile.gettempdir(), "pd_mtp.json") if args.quick else RESULTS)
    meta = versions()  # before measuring: the code this process imported
    log(f"building the checkpoint in {args.model_dir}")
    model = build(args.model_dir, damp=args.damp)
    log(f"  {model['parameters'] / 1e6:.0f}M parameters + MTP layer {model['mtp_parameters'] / 1e6:.0f}M")
    rng = random.Random(0)
    prompts = [[rng.randrange(100, model["config"]["vocab_size"]) for _ in range(args.prompt_len)]
               for _ in range(args.num_prompts + args.warmup)]
    warm, measured = prompts[:args.warmup], prompts[args.warmup:]
    results, rounds, load = {}, {}, {"before": os.getloadavg()}  # the box is shared: its load beside the timings
    names = args.configs.split(",")
    for r in range(args.rounds):
        for name in names if r % 2 == 0 else names[::-1]:
            kind, engine_args = configs(args.model_dir, args)[name]
            log(f"== round {r}, {name}: {' '.join(engine_args)}")
            got = run_config(kind, engine_args, warm + measured, args)
            log(f"   TTFT p50 {got['ttft_p50_s'] * 1e3:.0f} ms, TPOT p50 {got['tpot_p50_s'] * 1e3:.1f} ms, "
                f"tau {got.get('tau')}, errors {got['num_errors']}")
            rounds.setdefault(name, []).append({"ttft_p50_s": got["ttft_p50_s"], "tpot_p50_s": got["tpot_p50_s"],
                                                "tau": got.get("tau")})
            if name not in results or got["tpot_p50_s"] < results[name]["tpot_p50_s"]:
                results[name] = got
    for name, r in results.items():
        r["rounds"] = rounds[name]
    load["after"] = os.getloadavg()
    plain = results.get("unified_plain", {}).get("tokens")
    for name, r in results.items():
        tokens = r.pop("tokens")[args.warmup:]
        r["same_tokens_as_unified_plain"] = None if plain is None else tokens == plain[args.warmup:]
    base = results.get("unified_mtp")
    ratios = {}
    for name in ("pd_both", "pd_decode_only"):
        if base and name in results and base.get("tau"):
            r = results[name]
            ratios[name] = {"tau_over_unified": r.get("tau", 0) / base["tau"],
                            "tpot_p50_over_unified": r["tpot_p50_s"] / base["tpot_p50_s"],
                            "ttft_p50_over_unified": r["ttft_p50_s"] / base["ttft_p50_s"]}
    from specpd import machine
    write_json(out, {"benchmark": "bench_mtp_pd", "description": __doc__.split("\n\n")[0],
                     "command": command_line(), "date": datetime.date.today().isoformat(),
                     "machine": {**machine_info(), "cpu_isa": machine.isa(), "load_average_1_5_15": load}, **meta,
                     "model": {k: model[k] for k in ("parameters", "mtp_parameters", "damp", "config")},
                     "workload": {"prompts": args.num_prompts, "prompt_len": args.prompt_len,
                                  "max_tokens": args.max_tokens, "concurrency": 1, "greedy": True},
                     "configs": results, "against_unified_mtp": ratios})
    log(f"wrote {out}")


if __name__ == "__main__":
    main()
