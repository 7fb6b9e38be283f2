"""What evals/peers.py does with a started server: its streaming client (one cell: a closed loop of
`concurrency` requests), the parity prompts' greedy ids, τ around a cell, and a server's rep, one server at a time
(`serve_and_measure`) or a dtype's servers up together, each cell run on all of them back to back (`paired_rep`)."""
from __future__ import annotations

import asyncio
import contextlib
import time

import httpx

from evals import peers_servers as peers
from evals.harness.client import peer_request
from evals.harness.results import log, percentile

PARITY_PROMPTS, PARITY_TOKENS = 2, 32
PAIRED_GAP_S = 2.0  # --paired: between two servers' cells (vLLM's engine core spins ~1 s after its last request)
INTERLEAVED_GAP_S = 0.2  # --paired c1, specpd servers only: between two servers' requests (an idle one costs nothing)
# a specpd server puts what start-up left on 4 KB pages onto huge pages while idle (specpd/machine.py); on a box whose
# memory is fragmented that can be most of its weights and KV, and a b32 decode step on 4 KB pages ran ~4% slower
# (Zen 4 EPYC): a server is measured once that is done, as a user's server that has been up a while
HUGE_PAGES_WAIT_S = 300.0


# -- client ------------------------------------------------------------------------------------------
def run_cell(base: str, prompts: list[list[int]], concurrency: int, max_tokens: int) -> tuple[list[dict], float]:
    async def main():
        sem = asyncio.Semaphore(concurrency)
        # a connection per request: llama.cpp's HTTP server may close a kept-alive one as the next request is
        # sent on it ("Server disconnected without sending a response"); loopback connects cost ~0.1 ms
        limits = httpx.Limits(max_connections=concurrency + 4, max_keepalive_connections=0)
        async with httpx.AsyncClient(timeout=httpx.Timeout(3600.0), limits=limits) as client:
            async def gated(p):
                async with sem:
                    return await peer_request(client, base, p, max_tokens)
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
        d_verify, d_rounds = after[1] - before[1], after[2] - before[2]
        # the share of the cell's request rounds the adaptive policy ran at depth 0 (a plain step)
        return {"tau": committed / verify if verify else None, "verify_rounds": verify,
                "tau_server_info": (after[0] - before[0]) / d_verify if d_verify else None,
                "depth0_share": (after[3] - before[3]) / d_rounds if d_rounds else None}
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
    if spec.engine == "specpd":
        entry["huge_pages"] = settle_huge_pages(run)
    time.sleep(2.0)  # vLLM's engine core spins ~1 s after its last request: the settled cost is wanted
    entry["idle_cpu_share"] = peers.idle_cpu_share(run, 5.0)
    if spec.engine == "specpd":
        info = peers.get_json(run.base + "/server_info") or {}
        entry["server_info"] = {"config": info.get("config"), "speculative": info.get("speculative"),
                                **{k: v for k, v in info.items() if "default" in k or "thread" in k or "dtype" in k}}
    entry["cells"] = {}
    return entry


def settle_huge_pages(run: peers.Running) -> dict:
    """Wait (the server idle) until a specpd server's collapse onto huge pages after start-up has run, at most
    HUGE_PAGES_WAIT_S; its /server_info huge_pages then, with the seconds waited."""
    t0 = time.perf_counter()
    while True:
        status = (peers.get_json(run.base + "/server_info") or {}).get("huge_pages") or {}
        state = (status.get("collapse_after_start_up") or {}).get("state")
        if state != "running" or time.perf_counter() - t0 > HUGE_PAGES_WAIT_S:
            break
        time.sleep(1.0)
    status["waited_s"] = round(time.perf_counter() - t0, 1)
    log(f"   {run.spec.name}: {status.get('on_huge_pages_mib')} of {status.get('resident_mib')} MiB on huge pages "
        f"(collapse after start-up: {state}, waited {status['waited_s']} s)")
    return status


def measure_cell(run: peers.Running, entry: dict, workload: str, c: int, prompts: list[list[int]], args) -> dict:
    before = tau_probe(run)
    rows, wall = run_cell(run.base, prompts, c, args.max_tokens)
    return record_cell(run, entry, workload, c, rows, wall, before)


def measure_interleaved(runs: list[peers.Running], entries: dict[str, dict], workload: str,
                        prompts: list[list[int]], args, gap_s: float) -> None:
    """--paired, concurrency 1: the cell's prompts one at a time, each run on every server in turn (the order
    rotated prompt by prompt), so a prompt's servers are a second or two apart, not a whole cell (~8 s at 96 tokens)
    as with measure_cell one server after another: on a box whose speed drifts 10-50% over seconds (this one's
    plain c1 TPOT read 9.7 to 15.3 ms cell to cell in one run) that drift fell on one server's cell alone."""
    before = {run.spec.name: tau_probe(run) for run in runs}
    rows: dict[str, list[dict]] = {run.spec.name: [] for run in runs}
    wall = dict.fromkeys(rows, 0.0)
    for j, prompt in enumerate(prompts):
        k = j % len(runs)
        for run in runs[k:] + runs[:k]:
            got, seconds = run_cell(run.base, [prompt], 1, args.max_tokens)
            rows[run.spec.name] += got
            wall[run.spec.name] += seconds
            time.sleep(gap_s)
    for run in runs:
        name = run.spec.name
        cell = record_cell(run, entries[name], workload, 1, rows[name], wall[name], before[name])
        cell["tpot_s_by_prompt"] = [r.get("tpot_s") for r in rows[name]]  # the cell's prompts in order (pairs)


def record_cell(run: peers.Running, entry: dict, workload: str, c: int, rows: list[dict], wall: float,
                before) -> dict:
    spec = run.spec
    cell = summarize_rows(rows, wall)
    cell.update(tau_of(run, rows, before, tau_probe(run)))
    entry["cells"][f"{workload}/c{c}"] = cell
    log(f"   {spec.name:24s} {workload:8s} c{c:<3d} TPOT p50 {fmt_ms(cell['tpot_p50_s'])} ms  TTFT p50 "
        f"{fmt_ms(cell['ttft_p50_s'])} ms  {cell['output_tok_s']:.1f} tok/s  tau {fmt(cell.get('tau'))}"
        f"  errors {cell['num_errors']}" + (f"  depth-0 rounds {cell['depth0_share']:.0%}"
                                              if cell.get("depth0_share") is not None else ""))
    return cell


def finish(run: peers.Running, entry: dict) -> None:
    if entry.get("warmup_errors") or any(c["num_errors"] for c in entry["cells"].values()):
        entry["log_tail"] = peers.log_tail(run.log_path)
        entry["alive_after_cells"] = run.proc.poll() is None


def paired_rep(specs: list[peers.ServerSpec], cells: list[tuple[str, int]], plan: dict, rep: int,
               parity: list[list[int]], args) -> dict[str, dict]:
    """--paired: one rep of every server in `specs` up at once, each cell run on every server back to back (the
    order rotated cell by cell and rep by rep), so a cell's servers are minutes closer than one server's whole rep
    apart and the box's drift falls on them alike; at concurrency 1 request by request (measure_interleaved).
    Returns each server's entry, as serve_and_measure's."""
    entries: dict[str, dict] = {}
    with contextlib.ExitStack() as stack:
        runs = []
        for spec in specs:  # started one after another: start-up times are each server's own
            log(f"== rep {rep} {spec.name} (paired)")
            runs.append(stack.enter_context(peers.serve(spec)))
        for run in runs:
            entries[run.spec.name] = prepare(run, cells, parity)
        # between two servers' requests at c1: a vLLM or llama.cpp server beside may spin after its last one
        gap = INTERLEAVED_GAP_S if all(run.spec.engine == "specpd" for run in runs) else PAIRED_GAP_S
        for i, (workload, c) in enumerate(cells):
            shift = (rep + i) % len(runs)
            order = runs[shift:] + runs[:shift]
            if c == 1:
                measure_interleaved(order, entries, workload, plan[(workload, c, rep)], args, gap)
                time.sleep(PAIRED_GAP_S)
                continue
            for run in order:
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
