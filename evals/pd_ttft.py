"""PD time to first token against unified serving at equal prefill compute, with the TTFT breakdown.

Equal prefill compute: the unified server and the prefill server each run one torch thread pinned to core 0
(`taskset -c 0`); the decode server runs one thread on core 1. Within a phase every server is up at once and
the probes alternate unified / PD request by request (interleaved pairs on this shared box); each probe is
preceded by `/flush_cache` on the server it goes to, so every prompt is prefilled cold (defaults otherwise:
prefix caching on, optimistic prefill on, KV streamed per chunk, Mooncake over TCP on loopback).

Phases (fresh servers each): nonspec; eagle3 draft-on-both; eagle3 decode-only (EAGLE-3 = the shipped head
with the defaults of `--speculative-algorithm eagle3 --draft-model default`). Probes, greedy, streamed:
  short  held-out ShareGPT first turns (chat template), one at a time, 2 tokens out;
  4k     4096-token ShareGPT texts, one at a time;
  load   short probes while the decoding server (unified itself; D under PD) decodes --load-batch streams
         (ignore_eos), the blocks of unified and PD probes alternating.
Targets (issue 13): short, idle D: PD TTFT - unified TTFT <= 30 ms p50 (paired per prompt). 4k: the tail
from P's last chunk computed (draft extend included in draft-on-both) to D's commit <= one chunk's transfer
(+ one chunk's draft extend in decode-only: D's mean `d_draft_extend_chunk` over the request's streamed
chunks, the last included). The tail is P's `p_record + p_kv_submit + p_kv_write` (last chunk
-> its write complete, P's clock) plus D's `d_commit` (TransferDone in -> committed, D's clock); the ZMQ
hop between them (loopback) is not in either clock. One chunk's transfer: the request's KV seconds inside
the transfer backend / its writes (P's counters).

  python -m evals.pd_ttft            # -> evals/results/pd_ttft.json + pd_ttft.png
  python -m evals.pd_ttft --quick    # smoke -> $TMPDIR
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import sys
import tempfile
import time

EVALS_DIR = os.path.dirname(os.path.abspath(__file__))
from evals.harness.prompts import held_out_sharegpt_prompts, real_text_prompts
from evals.harness.results import command_line, log, machine_info, percentile, versions, write_json
from evals.harness.servers import transfer_backend
from evals.harness.client import kv_delta, one_request, stage_breakdown

import httpx

from specpd.server.launch import free_port, serve_processes

RESULTS_DIR = os.path.join(EVALS_DIR, "results")
TAIL_P = ("p_record", "p_kv_submit", "p_kv_write")
# the stages one after another on a request's path (p_wait_destination overlaps p_prefill under optimistic
# prefill, D's stages before the commit overlap P's)
PLOT_STAGES = ("p_admit", "p_queue", "p_prefill", "p_record", "p_kv_submit", "p_kv_write", "d_commit",
               "d_first_token_out")


@contextlib.contextmanager
def servers(engine_args: list[str], backend: str):
    """unified (core 0), P (core 0), D (core 1), one torch thread each, then the router: yields the URLs."""
    boot = free_port()
    common = ["--log-level", "warning", "--num-threads", "1", *engine_args]
    specs = [["--role", "unified", *common],
             ["--role", "prefill", "--bootstrap-port", str(boot), "--transfer-backend", backend, *common],
             ["--role", "decode", "--transfer-backend", backend, *common]]
    env = {"MC_LOG_LEVEL": "ERROR"}
    with serve_processes(specs, 900, cpus=["0", "0", "1"], env=env) as procs:
        uni, p, d = (base for _, base, _ in procs)
        with serve_processes([["--log-level", "warning", "--role", "router", "--prefill", p, "--decode", d,
                               "--bootstrap-port", str(boot)]], 120, env=env) as (router,):
            yield {"unified": uni, "router": router[1], "prefill": p, "decode": d}


async def stages(client: httpx.AsyncClient, urls: list[str]) -> dict:
    merged = {}
    for url in urls:
        merged.update((await client.get(url + "/server_info")).json().get("pd_stages") or {})
    return merged


async def probe(client: httpx.AsyncClient, base: str, prompt: list[int], max_tokens: int, pd_urls=None) -> dict:
    """One cold request (the cache flushed first); under PD also that request's stage durations and KV counters."""
    assert (await client.post(base + "/flush_cache")).status_code == 200
    if pd_urls:
        s0 = await stages(client, pd_urls)
        kv0 = (await client.get(pd_urls[1] + "/server_info")).json()
    row = await one_request(client, base, prompt, max_tokens, 0.0)
    assert "error" not in row, row
    if pd_urls:
        await asyncio.sleep(0.05)  # P observes the room when its write completes, D when y0 is out: both done
        s1 = await stages(client, pd_urls)
        kv1 = (await client.get(pd_urls[1] + "/server_info")).json()
        row["stages_ms"] = {k: v["mean_ms"] for k, v in stage_breakdown(s0, s1).items()}
        row["kv"] = kv_delta(kv0, kv1)
    row.pop("tokens", None)
    return row


def tail(row: dict) -> dict:
    """4k: last chunk computed -> D committed, against one chunk's transfer (module docstring)."""
    st, kv = row["stages_ms"], row["kv"]
    p_tail = sum(st.get(k, 0.0) for k in TAIL_P)
    writes = kv.get("kv_calls") or 1
    transfer = 1000 * kv["kv_transfer_s"] / writes
    extend = st.get("d_draft_extend_chunk")  # decode-only: D's mean draft extend over one streamed chunk
    tail_ms = p_tail + st.get("d_commit", 0.0)
    bound = transfer + (extend or 0.0)
    return {"p_tail_ms": p_tail, "d_commit_ms": st.get("d_commit"), "tail_ms": tail_ms,
            "one_chunk_transfer_ms": transfer, "one_chunk_draft_extend_ms": extend, "bound_ms": bound,
            "met": tail_ms <= bound, "writes": writes, "p_prefill_ms": st.get("p_prefill")}


def summary(xs: list[float]) -> dict:
    return {"p50": percentile(xs, 0.5), "p99": percentile(xs, 0.99), "min": min(xs), "max": max(xs), "n": len(xs)}


async def run_phase(urls: dict, short: list, long4k: list, load_prompts: list, args) -> dict:
    pd_urls = [urls["router"], urls["prefill"], urls["decode"]]
    out = {"short": [], "4k": [], "load": []}
    async with httpx.AsyncClient(timeout=httpx.Timeout(1800.0)) as client:
        for base in (urls["unified"], urls["router"]):  # first-request costs out of the measurement
            await probe(client, base, short[0], 2)
        for prompt in short:
            uni = await probe(client, urls["unified"], prompt, 2)
            pd = await probe(client, urls["router"], prompt, 2, pd_urls)
            out["short"].append({"prompt_tokens": len(prompt), "unified": uni, "pd": pd,
                                 "pd_minus_unified_ms": 1000 * (pd["ttft_s"] - uni["ttft_s"])})
        for prompt in long4k:
            uni = await probe(client, urls["unified"], prompt, 2)
            pd = await probe(client, urls["router"], prompt, 2, pd_urls)
            out["4k"].append({"prompt_tokens": len(prompt), "unified": uni, "pd": pd, "tail": tail(pd),
                              "pd_minus_unified_ms": 1000 * (pd["ttft_s"] - uni["ttft_s"])})
        for block in range(args.load_blocks):
            for name in ("unified", "router"):
                base = urls[name]
                load = [asyncio.create_task(one_request(client, base, p, args.load_tokens, 0.0)) for p in load_prompts]
                await asyncio.sleep(args.load_settle_s)  # the batch decoding before the probes
                decode_url = urls["decode"] if name == "router" else base
                running = (await client.get(decode_url + "/server_info")).json().get("num_running")
                for prompt in short[block::args.load_blocks]:
                    row = await probe(client, base, prompt, 2, pd_urls if name == "router" else None)
                    out["load"].append({"server": "pd" if name == "router" else "unified", "block": block,
                                        "decode_running": running, **row})
                for t in load:
                    t.cancel()
                await asyncio.gather(*load, return_exceptions=True)
                await asyncio.sleep(1.0)  # the aborts land
        infos = {k: (await client.get(u + "/server_info")).json() for k, u in urls.items() if k != "router"}
    out["pages_back_to_total"] = {k: i.get("free_pages") == i.get("total_pages") for k, i in infos.items()}
    return out


def report_phase(name: str, r: dict) -> dict:
    diffs = [x["pd_minus_unified_ms"] for x in r["short"]]
    s = {"short_ttft_unified_ms": summary([1000 * x["unified"]["ttft_s"] for x in r["short"]]),
         "short_ttft_pd_ms": summary([1000 * x["pd"]["ttft_s"] for x in r["short"]]),
         "short_pd_minus_unified_ms": summary(diffs),
         "short_target_met": percentile(diffs, 0.5) <= 30.0,
         "short_breakdown_p50_ms": {k: percentile([x["pd"]["stages_ms"][k] for x in r["short"]
                                                  if k in x["pd"]["stages_ms"]], 0.5)
                                    for k in r["short"][0]["pd"]["stages_ms"]}}
    if r["4k"]:
        s["4k_ttft_unified_ms"] = summary([1000 * x["unified"]["ttft_s"] for x in r["4k"]])
        s["4k_ttft_pd_ms"] = summary([1000 * x["pd"]["ttft_s"] for x in r["4k"]])
        s["4k_pd_minus_unified_ms"] = summary([x["pd_minus_unified_ms"] for x in r["4k"]])
        s["4k_tail"] = {k: percentile([x["tail"][k] for x in r["4k"] if x["tail"].get(k) is not None], 0.5)
                        for k in r["4k"][0]["tail"] if k != "met"}
        s["4k_tail_met"] = [x["tail"]["met"] for x in r["4k"]]  # per request: tail <= transfer (+ extend)
        s["4k_breakdown_p50_ms"] = {k: percentile([x["pd"]["stages_ms"][k] for x in r["4k"]
                                                  if k in x["pd"]["stages_ms"]], 0.5)
                                    for k in r["4k"][0]["pd"]["stages_ms"]}
    if r["load"]:
        for who in ("unified", "pd"):
            rows = [x for x in r["load"] if x["server"] == who]
            s[f"load_ttft_{who}_ms"] = summary([1000 * x["ttft_s"] for x in rows])
            s[f"load_decode_running_{who}"] = [x["decode_running"] for x in rows][:1]
    sh = s["short_pd_minus_unified_ms"]
    log(f"   {name} short: unified {s['short_ttft_unified_ms']['p50']:.1f} ms, PD {s['short_ttft_pd_ms']['p50']:.1f} ms, "
        f"PD - unified p50 {sh['p50']:.1f} ms [{sh['min']:.1f}, {sh['max']:.1f}]")
    if "4k_tail" in s:
        t = s["4k_tail"]
        log(f"   {name} 4k: unified {s['4k_ttft_unified_ms']['p50']:.0f} ms, PD {s['4k_ttft_pd_ms']['p50']:.0f} ms; "
            f"tail {t['tail_ms']:.1f} ms (P {t['p_tail_ms']:.1f} + D commit {t['d_commit_ms']:.1f}) vs one chunk's "
            f"transfer {t['one_chunk_transfer_ms']:.1f} ms"
            + (f" + one chunk's draft extend {t['one_chunk_draft_extend_ms']:.1f} ms"
               if t.get("one_chunk_draft_extend_ms") is not None else "") + f"; met {s['4k_tail_met']}")
    if "load_ttft_pd_ms" in s:
        log(f"   {name} load: unified {s['load_ttft_unified_ms']['p50']:.0f} ms, PD {s['load_ttft_pd_ms']['p50']:.0f} ms")
    return s


def plot(path: str, summaries: dict) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, 2, figsize=(13, 4.8))
    for ax, key, title in ((axes[0], "short_breakdown_p50_ms", "short prompts"),
                           (axes[1], "4k_breakdown_p50_ms", "4096-token prompts")):
        names = [n for n in summaries if key in summaries[n]]
        bottom = [0.0] * len(names)
        for stage in PLOT_STAGES:
            vals = [summaries[n][key].get(stage) or 0.0 for n in names]
            ax.bar(names, vals, bottom=bottom, label=stage)
            bottom = [b + v for b, v in zip(bottom, vals)]
        uni = [summaries[n]["short_ttft_unified_ms" if key.startswith("short") else "4k_ttft_unified_ms"]["p50"]
               for n in names]
        ax.scatter(names, uni, color="black", marker="_", s=900, zorder=3, label="unified TTFT p50")
        ax.set_title(f"PD TTFT breakdown (p50 per stage), {title}")
        ax.set_ylabel("ms")
        ax.legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--phases", default="nonspec,eagle3_both,eagle3_decode_only")
    ap.add_argument("--num-short", type=int, default=12)
    ap.add_argument("--num-4k", type=int, default=3)
    ap.add_argument("--long-len", type=int, default=4096)
    ap.add_argument("--load-batch", type=int, default=8)
    ap.add_argument("--load-tokens", type=int, default=1500)
    ap.add_argument("--load-blocks", type=int, default=2)
    ap.add_argument("--load-settle-s", type=float, default=8.0)
    ap.add_argument("--backend", default="mooncake", choices=("mooncake", "tcp"))
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if args.quick:
        args.phases, args.num_short, args.num_4k, args.long_len = "nonspec", 3, 1, 1024
        args.load_batch, args.load_blocks, args.load_settle_s, args.load_tokens = 2, 1, 3.0, 200
    out = args.out or (os.path.join(tempfile.gettempdir(), "specpd_pd_ttft_quick.json") if args.quick
                       else os.path.join(RESULTS_DIR, "pd_ttft.json"))
    args.backend = transfer_backend(args.backend)
    from specpd.model.loader import load_checkpoint
    tok = load_checkpoint("default").tokenizer
    short = held_out_sharegpt_prompts(tok, args.num_short)
    long4k, source = real_text_prompts(tok, args.num_4k, args.long_len)
    load_prompts = held_out_sharegpt_prompts(tok, args.num_short + args.load_batch)[args.num_short:]
    base = ["--model", "default", "--page-size", "16", "--kv-cache-memory-mb", "1024"]
    spec = ["--speculative-algorithm", "eagle3", "--draft-model", "default"]
    phases = {"nonspec": base, "eagle3_both": base + spec + ["--draft-mode", "both"],
              "eagle3_decode_only": base + spec + ["--draft-mode", "decode-only"]}
    raw, summaries = {}, {}
    t0 = time.perf_counter()
    for name in args.phases.split(","):
        log(f"== {name}")
        with servers(phases[name], args.backend) as urls:
            raw[name] = asyncio.run(run_phase(urls, short, long4k, load_prompts, args))
        summaries[name] = report_phase(name, raw[name])
        summaries[name]["pages_back_to_total"] = raw[name]["pages_back_to_total"]
    report = {"benchmark": "pd_ttft", "description": __doc__.split("\n\n")[0], "command": command_line(),
              "method": __doc__.split("\n\n")[1], "backend": args.backend, "long_prompt_source": source,
              "args": vars(args), "summary": summaries, "raw": raw, "bench_wall_s": round(time.perf_counter() - t0, 1),
              "versions": versions(), "machine": machine_info()}
    write_json(out, report)
    if not args.quick:
        plot(os.path.splitext(out)[0] + ".png", summaries)
    log(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
