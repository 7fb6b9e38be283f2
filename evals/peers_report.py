"""What evals/peers.py makes of its measurements: the per-cell summary over reps, the machine's CPU
features, the printed table, the plot and the estimate of a run's wall time."""
from __future__ import annotations

import statistics
import subprocess

FLAGS_OF_INTEREST = ("avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile", "avx512_vnni")
# a run's time where it has not measured the server yet: start-up s, output tok/s at c1 (SmolLM2-135M on a
# 2-core AVX-512/AMX box), and the throughput gain of c8 / c32 over c1 (rough: a 135M model's decode is
# mostly per-step overhead, batching amortizes it)
GUESS_STARTUP_S = {"specpd": 12.0, "vllm": 100.0, "llamacpp": 2.0}
GUESS_C1_TOK_S = {"specpd": 18.0, "vllm": 18.0, "llamacpp": 60.0}
GUESS_GAIN = {1: 1.0, 8: 4.0, 32: 8.0}


C1_REQUESTS = 24  # requests per c1 cell by default: a c1 cell's TPOT p50 is one request's, and with 8 a 1.3x
# ratio moved 0.3 from run to run (peers_spec, stops 57-58)
MIN_REQUESTS = 32  # and at least this many, twice the concurrency, in a wider cell (requests_per_cell)


def requests_per_cell(args, c: int) -> int:
    """Requests a cell runs at concurrency c (its clients in a closed loop: a finished request's client sends the
    next). Wider cells keep their clients busy for several requests, as serving benchmarks run (vLLM's `bench
    serve --max-concurrency`, SGLang's bench_serving), not one burst whose slowest request sets the wall: there a
    server that finishes some requests early (speculation) gains nothing from it, and a burst of 8 lasted ~2 s."""
    if args.requests:
        return args.requests
    return (getattr(args, "c1_requests", None) or C1_REQUESTS) if c == 1 else max(MIN_REQUESTS, 2 * c)


def lscpu() -> dict:
    try:
        text = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return {}
    fields = dict(line.split(":", 1) for line in text.splitlines() if ":" in line)
    fields = {k.strip(): v.strip() for k, v in fields.items()}
    flags = set(fields.get("Flags", "").split())
    return {"lscpu_model_name": fields.get("Model name"), "cpu_family_model_stepping":  # a VM may hide the name
            "/".join(fields.get(k, "?") for k in ("CPU family", "Model", "Stepping")), "cpus": fields.get("CPU(s)"),
            "cores_per_socket": fields.get("Core(s) per socket"), "threads_per_core": fields.get("Thread(s) per core"),
            "cpu_flags": {f: f in flags for f in FLAGS_OF_INTEREST}}


def _median(xs):
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def _spread(xs):
    xs = [x for x in xs if x is not None]
    return [min(xs), max(xs)] if xs else None


def summarize_cell(reps: list[dict]) -> dict:
    """Median over reps of each rep's figure, with the min-max spread; times in ms."""
    ms = lambda key: [r[key] * 1e3 if r.get(key) is not None else None for r in reps]  # noqa: E731
    out = {"reps": len(reps), "num_errors": sum(r["num_errors"] for r in reps)}
    for key, values in (("tpot_p50_ms", ms("tpot_p50_s")), ("tpot_p99_ms", ms("tpot_p99_s")),
                        ("ttft_p50_ms", ms("ttft_p50_s")), ("output_tok_s", [r["output_tok_s"] for r in reps]),
                        ("tau", [r.get("tau") for r in reps]), ("depth0_share", [r.get("depth0_share") for r in reps])):
        out[key], out[key + "_spread"] = _median(values), _spread(values)
    return out


def pairs(servers: dict, keys: list[str], q4_1_ref: str | None = None) -> dict:
    """Each server against specpd plain at its dtype (llama.cpp's q4_1: `q4_1_ref`, specpd plain at its default),
    rep by rep (rep r of both: with --paired, the same cell run back to back): tok/s over plain's and plain's TPOT
    p50 over its own (> 1: faster), median and min-max."""
    out = {}
    for name, server in servers.items():
        dtype = name.rsplit('/', 1)[1]
        ref = servers.get(q4_1_ref if dtype == "q4_1" and q4_1_ref else f"specpd/plain/{dtype}")
        if ref is None or name.startswith("specpd/plain/"):
            continue
        row = {}
        for key in keys:
            both = [(a["cells"][key], b["cells"][key]) for a, b in zip(server["reps"], ref["reps"])
                    if key in a.get("cells", {}) and key in b.get("cells", {})]
            tok = [a["output_tok_s"] / b["output_tok_s"] for a, b in both if b["output_tok_s"]]
            tpot = [b["tpot_p50_s"] / a["tpot_p50_s"] for a, b in both if a["tpot_p50_s"] and b["tpot_p50_s"]]
            if tok:
                row[key] = {"tok_s_ratio": _median(tok), "tok_s_ratio_spread": _spread(tok), "tok_s_ratios": tok,
                            "tpot_speedup": _median(tpot), "tpot_speedup_spread": _spread(tpot)}
                row[key].update(pooled_tpot(both))
        out[name] = row
    return out


def pooled_tpot(both: list[tuple[dict, dict]]) -> dict:
    """At c1 run prompt by prompt (measure_interleaved), every rep's requests together: plain's TPOT p50 over the
    server's (what one long run of the same requests would read) and, prompt by prompt, plain's TPOT over the
    server's: median and 10-90%. Empty where the cells did not record their prompts' TPOTs."""
    pairs_ = [(p, s) for a, b in both for s, p in zip(a.get("tpot_s_by_prompt") or [], b.get("tpot_s_by_prompt") or [])
              if p and s]
    if len(pairs_) < 10:
        return {}
    by_prompt = [p / s for p, s in pairs_]
    deciles = statistics.quantiles(by_prompt, n=10)
    return {"tpot_speedup_pooled": _median([p for p, _ in pairs_]) / _median([s for _, s in pairs_]),
            "tpot_speedup_by_prompt": _median(by_prompt), "tpot_speedup_by_prompt_10_90": [deciles[0], deciles[-1]],
            "pooled_requests": len(pairs_)}


def matching_prefix(a: list[int] | str, b: list[int] | str) -> int | None:
    """How many leading tokens two greedy outputs share (None when either is an error string)."""
    if not isinstance(a, list) or not isinstance(b, list):
        return None
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def parity_report(servers: dict, num_prompts: int, num_tokens: int) -> dict:
    """Each server's greedy parity tokens (its first rep's) against specpd plain's at the same dtype and at
    fp32: the matching prefix per prompt, and whether every prompt matched all `num_tokens`."""
    def tokens(name):
        got = [r["parity_tokens"] for r in servers.get(name, {}).get("reps", []) if "parity_tokens" in r]
        return got[0] if got else None

    out = {"prompts": num_prompts, "max_tokens": num_tokens, "servers": {}}
    for name in servers:
        mine, row = tokens(name), {}
        for ref_name in sorted({f"specpd/plain/{name.rsplit('/', 1)[1]}", "specpd/plain/fp32"} - {name}):
            ref = tokens(ref_name)
            if mine is not None and ref is not None:
                prefix = [matching_prefix(x, y) for x, y in zip(mine, ref)]
                row[f"vs_{ref_name}"] = {"matching_prefix": prefix, "equal": all(p == num_tokens for p in prefix)}
        out["servers"][name] = row
    return out


def table(report: dict) -> str:
    """One line per server and cell: TPOT p50 / p99, TTFT p50, tok/s, τ (medians over reps)."""
    lines = [f"{'server':26s} {'cell':14s} {'TPOT p50':>9s} {'p99':>7s} {'TTFT p50':>9s} {'tok/s':>7s} "
             f"{'tau':>5s} {'start s':>7s} {'idle cpu':>8s}"]
    for name, cells in report.get("cells", {}).items():
        reps = [r for r in report["servers"][name]["reps"] if "startup_s" in r]
        start = _median([r["startup_s"] for r in reps])
        idle = _median([r["idle_cpu_share"] for r in reps])
        for key, c in cells.items():
            if not c["reps"]:
                continue
            f = lambda v, w, p=1: f"{v:{w}.{p}f}" if v is not None else f"{'-':>{w}s}"  # noqa: E731
            lines.append(f"{name:26s} {key:14s} {f(c['tpot_p50_ms'], 9)} {f(c['tpot_p99_ms'], 7)} "
                         f"{f(c['ttft_p50_ms'], 9)} {f(c['output_tok_s'], 7)} {f(c['tau'], 5, 2)} "
                         f"{f(start, 7)} {f(idle, 8, 2)}")
    for s in report.get("skipped", []):
        lines.append(f"{s['server']:26s} skipped: {s['reason'][:150]}")
    for name, cells in report.get("pairs", {}).items():
        for key, c in cells.items():
            lo, hi = c["tok_s_ratio_spread"]
            lines.append(f"{name:26s} {key:14s} tok/s over specpd plain {c['tok_s_ratio']:.2f}x [{lo:.2f}-{hi:.2f}] "
                         f"over {len(c['tok_s_ratios'])} reps")
            if "tpot_speedup_pooled" in c:
                lo, hi = c["tpot_speedup_by_prompt_10_90"]
                lines.append(f"{name:26s} {key:14s} TPOT over specpd plain {c['tpot_speedup']:.2f}x (reps' median), "
                             f"{c['tpot_speedup_pooled']:.2f}x (p50 over all {c['pooled_requests']} requests), "
                             f"{c['tpot_speedup_by_prompt']:.2f}x prompt by prompt [{lo:.2f}-{hi:.2f} 10-90%]")
    return "\n".join(lines)


def plot(report: dict, path: str) -> None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    names = [n for n, cells in report["cells"].items() if any(c["reps"] for c in cells.values())]
    keys = sorted({k for n in names for k, c in report["cells"][n].items() if c["reps"]},
                  key=lambda k: (k.split("/")[0], int(k.split("/c")[1])))
    if not names or not keys:
        return
    colors = {"specpd": "tab:blue", "vllm": "tab:orange", "llamacpp": "tab:green"}
    fig, axes = plt.subplots(len(keys), 1, figsize=(max(8, 0.55 * len(names) + 2), 2.8 * len(keys)), squeeze=False)
    for ax, key in zip(axes[:, 0], keys):
        ys = [report["cells"][n][key]["tpot_p50_ms"] or 0 for n in names]
        spread = [report["cells"][n][key]["tpot_p50_ms_spread"] or [y, y] for n, y in zip(names, ys)]
        ax.bar(range(len(names)), ys, color=[colors.get(n.split("/")[0], "gray") for n in names],
               yerr=[[y - s[0] for y, s in zip(ys, spread)], [s[1] - y for y, s in zip(ys, spread)]], capsize=2)
        for i, n in enumerate(names):
            tau = report["cells"][n][key]["tau"]
            if tau:
                ax.text(i, ys[i], f"τ{tau:.2f}", ha="center", va="bottom", fontsize=7)
        ax.set_xticks(range(len(names)), [n.replace("/", "\n") for n in names], fontsize=7)
        ax.set_ylabel("TPOT p50 (ms)")
        ax.set_title(key, fontsize=9)
    m = report.get("machine", {})
    fig.suptitle(f"specpd vs peers, SmolLM2-135M, {m.get('lscpu_model_name')} x{m.get('cpus')}, greedy, "
                 f"{report['args']['max_tokens']} tokens (median of {report['args']['reps']} reps, min-max)", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def estimate_s(args, specs, report: dict | None) -> float:
    """Seconds a run of `args` over `specs` should take: start-ups and cells from `report`'s measurements of
    the same server where it has them (scaled by GUESS_GAIN for other concurrencies), else GUESS_*."""
    total = 0.0
    for spec in specs:
        measured = (report or {}).get("servers", {}).get(spec.name, {}).get("reps", [])
        startup = _median([r.get("startup_s") for r in measured]) or GUESS_STARTUP_S[spec.engine]
        c1 = _median([c["output_tok_s"] for r in measured for k, c in r.get("cells", {}).items() if k.endswith("/c1")])
        per_rep = startup + 10.0  # + parity prompts, idle probe, shutdown
        for c in args.concurrency:
            n = requests_per_cell(args, c)
            tok_s = (c1 or GUESS_C1_TOK_S[spec.engine]) * GUESS_GAIN.get(c, min(c, 8))
            per_rep += len(args.workloads) * n * args.max_tokens / tok_s
        total += args.reps * per_rep
    return total
