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
import functools
import json
import os
import re
import subprocess
import sys
from dataclasses import dataclass
from typing import Callable

from evals import report_readme
from evals.report_tables import (acceptance, attention, bench_mtp_pd, engine_quant, gemm_kernel, gemm_q, gpu,
                                 hf_generate, offline, overlap, pd, pd_load, pd_ttft, peers, peers_model_shape,
                                 peers_spec, prefix, profile_depth0, profile_spec_round, profile_step, q_rows, soak,
                                 spec_workloads, structured, tp, tp_matrix)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS_DIR = os.path.join(ROOT, "evals", "results")
PAGE = os.path.join(ROOT, "docs", "results.md")
BENCH_PAGE = os.path.join(ROOT, "docs", "benchmarks.md")
NOT_BENCHMARKS = {"peers_llamacpp.py", "report.py", "gpu_stage.py"}  # a peer's venv runs it; this; packs the GPU check
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
        command = rerun(command if command.startswith(("python", "specpd", "bash")) else f"python {command}")
    date = _find(data, ("date", "load_start_utc"))
    commit = str(commit)[:7] if commit and re.match(r"[0-9a-f]{7}", str(commit)) else commit
    args = None if command else {k: v for k, v in (_find(data, ("args",)) or {}).items() if k != "out"} or None
    return {"machine": ", ".join(str(x) for x in (machine, isa and f"ISA {isa}",
                                                   threads and f"{threads} torch threads") if x) or "?",
            "commit": commit or "?", "command": command, "args": args,
            "date": str(date)[:10] if date else _git_date(commit, path)}


# scripts renamed when evals/ became a package (issue 65): old name -> module, for the commands files recorded
RENAMED = {"acceptance": "spec_acceptance", "bench_peers": "peers", "bench_attention": "kernels_attention",
           "bench_gemm": "kernels_gemm",
           "bench_gemm_kernel": "kernels_gemm_kernel", "bench_gemm_q": "kernels_gemm_q", "bench_gpu": "gpu",
           "bench_hf": "engine_hf", "bench_mtp_pd": "pd_mtp", "bench_offline": "engine_offline", "bench_pd": "pd",
           "bench_pd_interleaved": "pd_interleaved", "bench_pd_ttft": "pd_ttft", "bench_prefix": "prefix",
           "bench_spec": "spec", "bench_structured": "engine_structured", "bench_tp": "tp",
           "draft_scaling": "spec_draft_scaling", "probe_overlap": "engine_overlap", "profile_depth0": "spec_depth0",
           "profile_spec_round": "spec_round_cost", "profile_step": "engine_step", "quant_e2e": "engine_quant",
           "transfer_under_load": "pd_transfer", "tune_spec_defaults": "spec_tuning"}


def rerun(command: str) -> str:
    """A recorded `python evals/<script>.py ARGS` as it runs today: `python -m evals.<module> ARGS`."""
    return re.sub(r"(python\S*\s+)evals/(\w+)\.py\b", lambda m: f"{m[1]}-m evals.{RENAMED.get(m[2], m[2])}", command)


@dataclass(frozen=True)
class Result:
    file: str
    script: str
    what: str
    summary: Callable[[dict], str] | None = None
    command: str | None = None  # how the file was made, where it does not record that itself


RESULTS = [
    Result("peers.json", "peers.py", "specpd beside vLLM's CPU build on the same box: plain, EAGLE-3 with "
           "the shipped head, n-gram; bf16 and fp32; chat and grounded rewrite; concurrency 1, 8, 32", peers),
    Result("peers_spec.json", "peers.py", "EAGLE-3 with the defaults against plain, through the server "
           "(issue 32's target)", peers_spec),
    Result("peers_llama-1b.json", "peers.py", "plain fp32 (and int8 / int4) at Llama-3.2-1B's shape (random weights) "
           "beside vLLM's CPU build, and c1 TPOT over the read floor", peers_model_shape),
    Result("engine_quant.json", "engine_quant.py", "resident memory per weight format; greedy agreement with the "
           "dense fp32 engine", engine_quant),
    Result("kernels_gemm_q.json", "kernels_gemm_q.py", "one forward's linears on the quantized kernel and the dense "
           "paths, by rows (a verify row's cost)", gemm_q),
    Result("kernels_q_rows.json", "kernels_q_rows.py", "a verify row's cost on the quantized kernel against the "
           "int8 dot-product peak measured beside it", q_rows),
    Result("engine_hf.json", "engine_hf.py", "plain decoding against HF transformers' `generate`, one request at "
           "a time, same weights", hf_generate),
    Result("engine_step.json", "engine_step.py", "one decode / verify step against the floor (bytes a step "
           "must read over the measured bandwidth)", profile_step),
    Result("engine_step_llama-1b.json", "engine_step.py", "the same at Llama-3.2-1B's shape (random weights), fp32, "
           "batch 1", profile_step),
    Result("spec_workloads.json", "spec.py", "speculation over plain in the engine, engines in lockstep "
           "(`python -m evals.spec --workloads --lockstep`)", spec_workloads),
    Result("spec.json", "spec.py", "the verify path's ceiling: replayed drafts with known acceptance"),
    Result("spec_trained.json", "spec.py", "the shipped head's speed in the engine, fixed depth",
           command="python -m evals.spec --draft-model default"),
    Result("spec_tuning.json", "spec_tuning.py", "tree shapes tried for the defaults (AVX-512/AMX box)"),
    Result("spec_tuning_avx2.json", "spec_tuning.py", "tree shapes tried for the defaults (AVX2 box)"),
    Result("spec_acceptance.json", "spec_acceptance.py", "τ of the shipped EAGLE-3 head, held-out ShareGPT and "
           "HumanEval", acceptance),
    Result("spec_acceptance_mtp.json", "spec_acceptance.py", "τ of the shipped MTP module, same prompts", acceptance),
    Result("spec_draft_scaling.json", "spec_draft_scaling.py", "τ against the head's training tokens"),
    Result("pd_serve_defaults.json", "pd.py", "1P1D as `make serve` runs it, spec against non-spec, both "
           "draft modes", pd),
    Result("pd.json", "pd.py", "1P1D against unified serving, KV transfer rates", pd),
    Result("pd_interleaved.json", "pd_interleaved.py", "PD spec against non-spec, clusters up at once, "
           "passes interleaved"),
    Result("pd_ttft.json", "pd_ttft.py", "PD time to first token against unified at equal prefill compute, "
           "with the breakdown", pd_ttft),
    Result("pd_ttft_decode_only.json", "pd_ttft.py", "the same, draft-on-decode-only", pd_ttft),
    Result("pd_mtp.json", "pd_mtp.py", "a DeepSeek-V3-shaped MoE (MLA) with its own MTP layer: 1P1D "
           "in both draft modes against the unified server, τ, TTFT, TPOT", bench_mtp_pd),
    Result("pd_spec_repeat.json", "pd_spec_repeat.py", "does D speculate as often as unified, over restarts"),
    Result("pd_load.json", "pd_load.py", "a 1P1D cluster under a burst with long prompts and a busy neighbour: "
           "failures, pages back, heartbeats", pd_load),
    Result("pd_transfer.json", "pd_transfer.py", "raw Mooncake loopback rates with and without "
           "load"),
    Result("prefix.json", "prefix.py", "prefix caching on and off, unified and 1P1D, multi-turn", prefix),
    Result("engine_structured.json", "engine_structured.py", "JSON-schema output: mask cost, τ with a grammar",
           structured),
    Result("tp.json", "tp.py", "TP 1 against TP 3 on this box, the all-reduce share, KV descriptors per "
           "page for each P→D TP pair", tp),
    Result("tp_matrix.json", "tp_matrix.py", "every P→D TP pair, draft mode and tree shape against unified TP 1",
           tp_matrix),
    Result("engine_offline.json", "engine_offline.py", "the offline engine against HF `generate`", offline),
    Result("kernels_attention.json", "kernels_attention.py", "the CPU paged-attention kernel against an earlier commit",
           attention),
    Result("kernels_gemm.json", "kernels_gemm.py", "GEMM paths (oneDNN, MKL, the few-row kernel) by rows and threads"),
    Result("kernels_gemm_kernel.json", "kernels_gemm_kernel.py", "the few-row GEMM kernel against an earlier "
           "commit, one forward's linears by rows", gemm_kernel),
    Result("spec_round_cost.json", "spec_round_cost.py", "a speculative round at batch 1 against a plain step, "
           "and the adaptive policy against every round at the full tree", profile_spec_round),
    Result("spec_depth0.json", "spec_depth0.py", "where a spec engine's step goes when it does not "
           "speculate", profile_depth0),
    Result("engine_overlap.json", "engine_overlap.py", "host work beside the forward against the same work after "
           "it: would an overlap scheduler pay here", overlap),
    Result("soak.json", "soak.py", "30 minutes of mixed load through the supervised cluster", soak),
    Result("gpu.json", "gpu.py", "the engine on one H200 (random weights, SmolLM2's shape)", gpu),
]


@functools.cache
def load(file: str) -> dict:
    """A result file's JSON (read once: the results page, the benchmarks page and the README use them)."""
    with open(os.path.join(RESULTS_DIR, file)) as f:
        return json.load(f)


def described(r: Result) -> dict:
    """provenance() of r's file, its command falling back to what RESULTS says, then to the bare script."""
    p = provenance(load(r.file), os.path.join(RESULTS_DIR, r.file))
    p["command"] = p["command"] or r.command or f"python -m evals.{r.script.removesuffix('.py')}"
    return p


def section(r: Result) -> str:
    data, p = load(r.file), described(r)
    plot = r.file.replace(".json", ".png")
    lines = [f"## {r.file}", "", f"{r.what}. Written by `evals/{r.script}`.", "", f"- command: `{p['command']}`",
             *([f"- arguments recorded: `{json.dumps(p['args'], separators=(',', ':'))}`"] if p["args"] else []),
             f"- machine: {p['machine']}", f"- commit: {p['commit']}", f"- date: {p['date']}"]
    for recheck in data.get("rechecks", []):
        command = rerun(re.sub(r"\s--out\s+\S+", "", recheck["command"]))
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
             "tests; ratios are taken side by side in one run, interleaved, with the spread. Each is a module "
             "`evals/<subject>_<what>.py` (`evals/<subject>.py` for a subject's main one; subjects: peers, spec, "
             "pd, prefix, tp, soak, gpu, kernels, engine) that writes `evals/results/<module>.json` "
             "(`<module>_<variant>.json` for a mode or box it records apart); what they share (servers, the "
             "streaming client, prompts, the result writer) is `evals/harness/`. Run one from the repository root "
             "with `.venv/bin/python -m evals.<module>` after `make install`; the peers (vLLM's CPU build, "
             "llama.cpp) come from `make peers`; on a GPU, `bash evals/gpu_check.sh OUT` runs the device tests and "
             "`python -m evals.gpu`. Current numbers: [results.md](results.md).", ""]
    for script in sorted(f for f in os.listdir(os.path.join(ROOT, "evals")) if f.endswith(".py")):
        with open(os.path.join(ROOT, "evals", script)) as f:
            source = f.read()
        if script in NOT_BENCHMARKS or '__name__ == "__main__"' not in source:
            continue  # a module the benchmarks share
        doc = ast.get_docstring(ast.parse(source)) or ""
        what = " ".join(doc.split("\n\n")[0].split())
        lines += [f"## evals/{script}", "", what, ""]
        for r in (r for r in RESULTS if r.script == script):
            lines.append(f"- [`evals/results/{r.file}`](results.md#{r.file.replace('.', '')}): {r.what}; "
                         f"`{described(r)['command']}`")
        lines.append("")
    return "\n".join(lines)


def render_readme_summary() -> str:
    p = provenance(load("peers.json"), os.path.join(RESULTS_DIR, "peers.json"))
    return report_readme.render(load("peers.json"), p["command"])


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
