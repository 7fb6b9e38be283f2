"""One page of every benchmark's current result: `python -m evals.report` -> docs/results.md, and the
README's summary (between its `results:begin` / `results:end` markers) cut from the same tables.

Each benchmark has one canonical JSON under evals/results/ (RESULTS below: file, the script that writes it,
what it measures, and a function that turns it into a Markdown table). The page names, for every file, the
machine, the specpd commit measured, the command and the date, all read from the JSON; a file that does not
record its date gets the date of the git commit that last wrote it. `--check` exits 1 when docs/results.md or
the README summary is not what this would write (a test runs it).
"""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
from dataclasses import dataclass
from typing import Callable

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS_DIR = os.path.join(ROOT, "evals", "results")
PAGE = os.path.join(ROOT, "docs", "results.md")
BENCH_PAGE = os.path.join(ROOT, "docs", "benchmarks.md")
NOT_BENCHMARKS = {"peers_llamacpp.py", "report.py"}  # run by bench_peers in the peer's venv; this
README = os.path.join(ROOT, "README.md")
BEGIN, END = "<!-- results:begin (python -m evals.report) -->", "<!-- results:end -->"


def _find(data, keys: tuple[str, ...]):
    """The first value under any of `keys`, searching dicts breadth-first (lists are not entered)."""
    level = [data]
    while level:
        for d in level:
            for k in keys:
                if isinstance(d, dict) and d.get(k) not in (None, "", []):
                    return d[k]
        level = [v for d in level if isinstance(d, dict) for v in d.values() if isinstance(v, dict)]
    return None


def _git_date(commit: str | None, path: str) -> str:
    """The date of the commit measured, else of the last commit that wrote the file."""
    tries = (["show", "-s", "--format=%cs", commit] if commit else None, ["log", "-1", "--format=%cs", "--", path])
    for args in tries:
        out = args and subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True)
        if out and out.returncode == 0 and out.stdout.strip():
            return out.stdout.strip()
    return "unknown"


def provenance(data: dict, path: str) -> dict:
    """Machine, commit, command and date of one result file."""
    machine = _find(data, ("cpu_model", "gpu"))
    isa = _find(data, ("isa", "cpu_isa"))
    threads = _find(data, ("torch_num_threads",))
    commit = _find(data, ("specpd_commit", "commit"))
    command = _find(data, ("command", "commands"))
    command = command[0] if isinstance(command, list) else command
    if command:
        command = re.sub(r"\s--out\s+\S+", "", command)  # renamed to its canonical name since
        command = command if command.startswith(("python", "specpd", "bash")) else f"python {command}"
    date = _find(data, ("date", "load_start_utc"))
    commit = str(commit)[:7] if commit and re.match(r"[0-9a-f]{7}", str(commit)) else commit
    args = None if command else {k: v for k, v in (_find(data, ("args",)) or {}).items() if k != "out"} or None
    return {"machine": ", ".join(str(x) for x in (machine, isa and f"ISA {isa}",
                                                   threads and f"{threads} torch threads") if x) or "?",
            "commit": commit or "?", "command": command, "args": args,
            "date": str(date)[:10] if date else _git_date(commit, path)}


def _f(x, p=2, suffix=""):
    return "–" if x is None else f"{x:.{p}f}{suffix}"


def _spread(x, p=2):
    return f" ({_f(x[0], p)}–{_f(x[1], p)})" if x else ""


def _table(header: list[str], rows: list[list]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


# --- one table per benchmark -----------------------------------------------------------------------------
def peer_cells(d: dict) -> dict:
    """The cells of a bench_peers run, later rechecks replacing the cells they measured again."""
    cells = {name: dict(c) for name, c in d["cells"].items()}
    for recheck in d.get("rechecks", []):
        for name, c in recheck["cells"].items():
            cells.setdefault(name, {}).update({k: v for k, v in c.items() if v.get("reps")})
    return cells


def peers(d: dict) -> str:
    cells, rows = peer_cells(d), []
    configs = sorted({n.split("/", 1)[1] for n in cells}, key=lambda s: (s.split("/")[1], s))
    workloads = sorted({k.split("/")[0] for c in cells.values() for k in c})
    for config in configs:
        for w in workloads:
            row = [config.replace("/", " "), w]
            for key, field, p in ((f"{w}/c1", "tpot_p50_ms", 1), (f"{w}/c8", "output_tok_s", 0),
                                  (f"{w}/c32", "output_tok_s", 0)):
                for engine in ("specpd", "vllm"):
                    c = cells.get(f"{engine}/{config}", {}).get(key) or {}
                    row.append(_f(c.get(field), p) + _spread(c.get(field + "_spread"), p))
            taus = [cells.get(f"{e}/{config}", {}).get(f"{w}/c1", {}).get("tau") for e in ("specpd", "vllm")]
            row.append(" / ".join(_f(t) for t in taus))
            rows.append(row)
    return _table(["config", "workload", "specpd TPOT c1 ms", "vLLM TPOT c1 ms", "specpd tok/s c8",
                   "vLLM tok/s c8", "specpd tok/s c32", "vLLM tok/s c32", "τ c1 specpd / vLLM"], rows)


def peers_spec(d: dict) -> str:
    cells, rows = peer_cells(d), []
    plain, spec = cells["specpd/plain/bf16"], cells["specpd/eagle3/bf16"]
    for key in plain:
        field = "tpot_p50_ms" if key.endswith("/c1") else "output_tok_s"
        ratio = plain[key][field] / spec[key][field] if field == "tpot_p50_ms" else spec[key][field] / plain[key][field]
        rows.append([key, _f(plain[key][field], 1) + _spread(plain[key][field + "_spread"], 1),
                     _f(spec[key][field], 1) + _spread(spec[key][field + "_spread"], 1), _f(ratio, 2, "×"),
                     _f(spec[key]["tau"])])
    return _table(["cell", "plain (TPOT ms at c1, tok/s above)", "eagle3 defaults", "eagle3 over plain", "τ"],
                  rows)


def spec_workloads(d: dict) -> str:
    rows = []
    for cell, configs in d["runs"].items():
        for name, c in configs.items():
            if name != "non_spec":
                rows.append([cell, name, _f(c["vs_non_spec"], 3, "×") + _spread(c.get("spread"), 3),
                             _f(c.get("tau")), _f(c.get("rounds_off_share"))])
    return _table(["workload/batch", "config", "decode tok/s vs non-spec", "τ", "share of rounds at depth 0"],
                  rows)


def acceptance(d: dict) -> str:
    rows = []
    for config, by_set in d["results"].items():
        row = [config]
        for name, r in by_set.items():
            for t, v in sorted(r.items()):
                if isinstance(v, dict) and "tau" in v:
                    row.append(f"{name} {t}: {_f(v['tau'])}")
        rows.append([row[0], "; ".join(row[1:])])
    return _table(["draft shape", "τ (tokens per verify, bonus included)"], rows)


def pd(d: dict) -> str:
    rows = []
    for config, r in d["results"].items():
        s = r.get("short", {})
        rows.append([config, _f((s.get("ttft_p50_s") or 0) * 1e3, 0), _f((s.get("tpot_p50_s") or 0) * 1e3, 1),
                     _f((s.get("tpot_p99_s") or 0) * 1e3, 1), s.get("num_errors", "–")])
    table = _table(["config", "short TTFT p50 ms", "TPOT p50 ms", "TPOT p99 ms", "errors"], rows)
    ratios = [f"- {k}: median {_f(v['median'])} ({_f(v['min'])}–{_f(v['max'])})"
              for k, v in d.get("ratios", {}).items() if isinstance(v, dict) and "median" in v]
    return table + ("\n\n" + "\n".join(ratios) if ratios else "")


def pd_ttft(d: dict) -> str:
    rows = []
    for phase, s in d["summary"].items():
        rows.append([phase, _f(s["short_ttft_unified_ms"]["p50"], 0), _f(s["short_ttft_pd_ms"]["p50"], 0),
                     _f(s["short_pd_minus_unified_ms"]["p50"], 1), _f(s["4k_ttft_unified_ms"]["p50"], 0),
                     _f(s["4k_ttft_pd_ms"]["p50"], 0), _f(s["4k_tail"]["tail_ms"], 1)])
    return _table(["phase", "short unified p50 ms", "short PD p50 ms", "PD − unified p50 ms", "4k unified p50 ms",
                   "4k PD p50 ms", "4k tail after prefill ms"], rows)


def prefix(d: dict) -> str:
    rows = [[name, _f(c.get("ttft_turn1_p50_s", 0) * 1e3, 0), _f(c.get("ttft_later_p50_s", 0) * 1e3, 0),
             _f(c.get("hit_rate"))] for name, c in d["multi_turn"]["configs"].items()]
    return _table(["config", "TTFT turn 1 p50 ms", "TTFT later turns p50 ms", "prefix hit rate"], rows)


def tp(d: dict) -> str:
    s = d["summary"]
    rows = [[b, _f(s[b]["tp1_step_ms_median"], 1), _f(s[b]["tp3_step_ms_median"], 1),
             _f(s[b]["all_reduce_share_median"])] for b in ("b1", "b8")]
    pairs = ", ".join(f"{p['prefill_tp']}→{p['decode_tp']}: {_f(p['descriptors_per_page'])}"
                      for p in d["pd_descriptors"])
    return (_table(["batch", "TP 1 step ms", "TP 3 step ms", "all-reduce share of the TP 3 step"], rows)
            + f"\n\nPrefill of {d['prefill_tokens']} tokens: TP 1 {_f(s['prefill']['tp1_ms_median'], 0)} ms, "
              f"TP 3 {_f(s['prefill']['tp3_ms_median'], 0)} ms. KV descriptors per page, P→D TP: {pairs}.")


def tp_matrix(d: dict) -> str:
    rows = [[c["shape"], c["draft_mode"], f"{c['prefill_tp']}→{c['decode_tp']}", all(c["text_equal"]),
             c["tau_equal"]] for c in d["cases"]]
    return _table(["tree", "draft mode", "P→D TP", "text equals unified TP 1", "τ equal"], rows)


def structured(d: dict) -> str:
    rows = [[r["config"], r["batch"], r["mode"], _f(r["tpot_ms"], 1), _f(r.get("tau")), _f(r["mask_share"], 3),
             r.get("valid", "–")] for r in d["results"]]
    return _table(["config", "batch", "mode", "TPOT ms", "τ", "mask share of the step", "valid JSON"], rows)


def attention(d: dict) -> str:
    rows = [[name, _f(c["current_ms"], 1), _f(c["against_ms"], 1), _f(c["speedup"], 2, "×"),
             c.get("bit_identical", "–")] for name, c in d["cases"].items()]
    return _table(["case (30 layer calls)", "ms", f"ms at {d['args']['against']}", "speed-up", "bit-identical"],
                  rows)


def profile_step(d: dict) -> str:
    rows = [[name, _f(c["step_ms"], 1), _f(c["floor_ms"], 1), _f(c["step_ms"] / c["floor_ms"], 2, "×"),
             _f(c["gemm_ms"], 1), _f(c["attention_ms"], 1)] for name, c in d["cases"].items()]
    return _table(["case", "step ms", "floor ms", "over the floor", "GEMMs ms", "attention ms"], rows)


def profile_depth0(d: dict) -> str:
    rows = []
    for name, c in d["configs"].items():
        r, ms = sorted(c["ratio_vs_non_spec"]), c["ms_per_step"]
        rows.append([name, _f(r[len(r) // 2], 3, "×") + _spread([r[0], r[-1]], 3), _f(ms["step"], 1),
                     _f(ms.get("draft_extend"), 2), _f(ms.get("policy_plan"), 2), _f(c.get("rounds_off_share"))])
    return _table(["config", "decode tok/s vs non-spec", "step ms", "draft extends ms", "policy ms",
                   "share of rounds at depth 0"], rows)


def soak(d: dict) -> str:
    s = d["summary"]
    kinds = ", ".join(f"{k} {v}" for k, v in s["by_kind"].items())
    return (f"{s['sent']} requests over {d['args']['minutes']:.0f} min: {s['completed']} completed, "
            f"{s['expected_refusals']} refused as they should be ({kinds}), "
            f"**{s['failed']} failed, {s['lost']} lost**; TTFT p50 {_f(s['ttft_s']['p50'])} s, short prompts "
            f"{_f(s['ttft_s_short']['p50'])} s.")


def offline(d: dict) -> str:
    rows = [[r["engine"], r["config"], r["batch_size"], _f(r["decode_tokens_per_s"], 1), _f(r["tokens_per_s"], 1),
             _f(r["ttft_s"], 2)] for r in d["results"]]
    return _table(["engine", "config", "batch", "decode tok/s", "end-to-end tok/s", "TTFT s"], rows)


def gpu(d: dict) -> str:
    rows = [[k, _f(v["tpot_ms"], 1), _f(v.get("tau")), _f(v.get("tok_s_over_plain"), 2, "×"),
             v.get("greedy_equals_plain", "–")] for k, v in {**d["plain"], **d["spec"]}.items()]
    return _table(["dtype/backend/config/batch", "TPOT ms", "τ", "over plain", "greedy equals plain"], rows)


@dataclass(frozen=True)
class Result:
    file: str
    script: str
    what: str
    summary: Callable[[dict], str] | None = None
    command: str | None = None  # how the file was made, where it does not record that itself


RESULTS = [
    Result("peers.json", "bench_peers.py", "specpd beside vLLM's CPU build on the same box: plain, EAGLE-3 with "
           "the shipped head, n-gram; bf16 and fp32; chat and grounded rewrite; concurrency 1, 8, 32", peers),
    Result("peers_spec.json", "bench_peers.py", "EAGLE-3 with the defaults against plain, through the server "
           "(issue 32's target)", peers_spec),
    Result("profile_step.json", "profile_step.py", "one decode / verify step against the floor (bytes a step "
           "must read over the measured bandwidth)", profile_step),
    Result("spec_workloads.json", "bench_spec.py", "speculation over plain in the engine, engines in lockstep "
           "(`evals/bench_spec.py --workloads --lockstep`)", spec_workloads),
    Result("spec.json", "bench_spec.py", "the verify path's ceiling: replayed drafts with known acceptance"),
    Result("spec_trained.json", "bench_spec.py", "the shipped head's speed in the engine, fixed depth",
           command="python evals/bench_spec.py --draft-model default"),
    Result("spec_tuning.json", "tune_spec_defaults.py", "tree shapes tried for the defaults (AVX-512/AMX box)"),
    Result("spec_tuning_avx2.json", "tune_spec_defaults.py", "tree shapes tried for the defaults (AVX2 box)"),
    Result("acceptance.json", "acceptance.py", "τ of the shipped EAGLE-3 head, held-out ShareGPT and HumanEval",
           acceptance),
    Result("acceptance_mtp.json", "acceptance.py", "τ of the shipped MTP module, same prompts", acceptance),
    Result("draft_scaling.json", "draft_scaling.py", "τ against the head's training tokens"),
    Result("pd_serve_defaults.json", "bench_pd.py", "1P1D as `make serve` runs it, spec against non-spec, both "
           "draft modes", pd),
    Result("pd.json", "bench_pd.py", "1P1D against unified serving, KV transfer rates", pd),
    Result("pd_interleaved.json", "bench_pd_interleaved.py", "PD spec against non-spec, clusters up at once, "
           "passes interleaved"),
    Result("pd_ttft.json", "bench_pd_ttft.py", "PD time to first token against unified at equal prefill compute, "
           "with the breakdown", pd_ttft),
    Result("pd_ttft_decode_only.json", "bench_pd_ttft.py", "the same, draft-on-decode-only", pd_ttft),
    Result("pd_spec_repeat.json", "pd_spec_repeat.py", "does D speculate as often as unified, over restarts"),
    Result("pd_load.json", "pd_load.py", "a 1P1D cluster under long prompts: heartbeats, pages back, failures"),
    Result("transfer_under_load.json", "transfer_under_load.py", "raw Mooncake loopback rates with and without "
           "load"),
    Result("prefix.json", "bench_prefix.py", "prefix caching on and off, unified and 1P1D, multi-turn", prefix),
    Result("structured.json", "bench_structured.py", "JSON-schema output: mask cost, τ with a grammar",
           structured),
    Result("tp.json", "bench_tp.py", "TP 1 against TP 3 on this box, the all-reduce share, KV descriptors per "
           "page for each P→D TP pair", tp),
    Result("tp_matrix.json", "tp_matrix.py", "every P→D TP pair, draft mode and tree shape against unified TP 1",
           tp_matrix),
    Result("offline.json", "bench_offline.py", "the offline engine against HF `generate`", offline),
    Result("attention.json", "bench_attention.py", "the CPU paged-attention kernel against an earlier commit",
           attention),
    Result("gemm.json", "bench_gemm.py", "GEMM paths (oneDNN, MKL, the few-row kernel) by rows and threads"),
    Result("profile_depth0.json", "profile_depth0.py", "where a spec engine's step goes when it does not "
           "speculate", profile_depth0),
    Result("soak.json", "soak.py", "30 minutes of mixed load through the supervised cluster", soak),
    Result("gpu.json", "bench_gpu.py", "the engine on one H200 (random weights, SmolLM2's shape)", gpu),
]


def section(r: Result) -> str:
    path = os.path.join(RESULTS_DIR, r.file)
    with open(path) as f:
        data = json.load(f)
    p = provenance(data, path)
    p["command"] = p["command"] or r.command
    plot = r.file.replace(".json", ".png")
    lines = [f"## {r.file}", "", f"{r.what}. Written by `evals/{r.script}`.", "",
             f"- command: `{p['command']}`" if p["command"] else f"- command: `python evals/{r.script}`",
             *([f"- arguments recorded: `{json.dumps(p['args'], separators=(',', ':'))}`"] if p["args"] else []),
             f"- machine: {p['machine']}", f"- commit: {p['commit']}", f"- date: {p['date']}"]
    for recheck in data.get("rechecks", []):
        command = re.sub(r"\s--out\s+\S+", "", recheck["command"])
        lines.append(f"- recheck (`{command}`): {recheck['why']}")
    if os.path.exists(os.path.join(RESULTS_DIR, plot)):
        lines.append(f"- plot: [{plot}](../evals/results/{plot})")
    if r.summary:
        lines += ["", r.summary(data)]
    return "\n".join(lines)


def render_page() -> str:
    head = ["# Results", "", "Generated by `python -m evals.report` from the canonical result file of each "
            "benchmark in `evals/results/` (older runs are in git history). What each benchmark measures and how "
            "to run it: [benchmarks.md](benchmarks.md). Medians over repetitions, min–max in parentheses.", ""]
    index = [f"- [{r.file}](#{r.file.replace('.', '')}) — {r.what}" for r in RESULTS]
    return "\n".join(head + index + [""] + [section(r) + "\n" for r in RESULTS])


def render_benchmarks() -> str:
    """docs/benchmarks.md: every script under evals/, what its docstring says it measures, the command its
    canonical result was made with, and that file."""
    import ast
    lines = ["# Benchmarks", "", "Every benchmark under `evals/` (generated by `python -m evals.report` from each "
             "script's docstring and its canonical result file). Speed is measured by these, never by timed "
             "tests; ratios are taken side by side in one run, interleaved, with the spread. Run one with "
             "`.venv/bin/python evals/<script>` after `make install`; the peers (vLLM's CPU build, llama.cpp) "
             "come from `make peers`; on a GPU, `bash evals/gpu_check.sh OUT` runs the device tests and "
             "`evals/bench_gpu.py`. Current numbers: [results.md](results.md).", ""]
    for script in sorted(f for f in os.listdir(os.path.join(ROOT, "evals")) if f.endswith(".py")):
        with open(os.path.join(ROOT, "evals", script)) as f:
            source = f.read()
        if script in NOT_BENCHMARKS or '__name__ == "__main__"' not in source:
            continue  # a module the benchmarks share
        doc = ast.get_docstring(ast.parse(source)) or ""
        what = " ".join(doc.split("\n\n")[0].split())
        lines += [f"## evals/{script}", "", what, ""]
        for r in (r for r in RESULTS if r.script == script):
            with open(os.path.join(RESULTS_DIR, r.file)) as f:
                p = provenance(json.load(f), os.path.join(RESULTS_DIR, r.file))
            p["command"] = p["command"] or r.command
            lines.append(f"- [`evals/results/{r.file}`](results.md#{r.file.replace('.', '')}): {r.what}; "
                         f"`{p['command'] or 'python evals/' + script}`")
        lines.append("")
    return "\n".join(lines)


def render_readme_summary() -> str:
    with open(os.path.join(RESULTS_DIR, "peers.json")) as f:
        data = json.load(f)
    p = provenance(data, os.path.join(RESULTS_DIR, "peers.json"))
    return (f"specpd against vLLM's CPU build on the same box ({p['machine']}), the same SmolLM2-135M weights "
            f"and EAGLE-3 head, bf16/fp32, one OpenAI streaming client, greedy; medians of 3 rotated repetitions "
            f"(min–max). From `evals/results/peers.json` (commit {p['commit']}); every other benchmark: "
            f"[docs/results.md](docs/results.md).\n\n{peers(data)}")


def readme_with_summary(readme: str) -> str:
    start, end = readme.index(BEGIN) + len(BEGIN), readme.index(END)
    return readme[:start] + "\n" + render_readme_summary() + "\n" + readme[end:]


def _without_dates(page: str) -> str:
    return "\n".join(line for line in page.splitlines() if not line.startswith("- date:"))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--check", action="store_true", help="exit 1 when docs/results.md or the README is stale")
    args = ap.parse_args()
    page, bench_page = render_page(), render_benchmarks()
    with open(README) as f:
        readme = f.read()
    new_readme = readme_with_summary(readme) if BEGIN in readme else readme
    if args.check:
        shallow = subprocess.run(["git", "rev-parse", "--is-shallow-repository"], cwd=ROOT, capture_output=True,
                                 text=True).stdout.strip() != "false"
        # a shallow clone lacks the commits a date is read from: compare the rest
        same = (lambda a, b: _without_dates(a) == _without_dates(b)) if shallow else (lambda a, b: a == b)
        stale = []
        for path, new in ((PAGE, page), (BENCH_PAGE, bench_page), (README, new_readme)):
            with open(path) as f:
                if not same(f.read(), new):
                    stale.append(os.path.relpath(path, ROOT))
        if stale:
            print(f"stale: {', '.join(stale)} (run python -m evals.report)", file=sys.stderr)
        return 1 if stale else 0
    os.makedirs(os.path.dirname(PAGE), exist_ok=True)
    for path, new in ((PAGE, page), (BENCH_PAGE, bench_page), (README, new_readme)):
        with open(path, "w") as f:
            f.write(new)
    print(f"wrote {os.path.relpath(PAGE, ROOT)} ({len(RESULTS)} results)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
