"""Prefix caching on vs off, unified and 1P1D, EAGLE-3: TTFT of multi-turn chats and of a shared system prompt.

Servers are real `specpd serve` processes on 127.0.0.1, all started at once and kept up for the whole run:
unified with the cache, unified without (`--disable-prefix-caching`), the same pair as 1P1D (P pinned to
core 0, D to core 1 with `taskset`, behind a router; D's default `--pd-local-prefill-tokens 128`), and
`pd_on_p`: 1P1D with the cache and `--pd-local-prefill-tokens 0` on D, so every turn takes the P path (P's
own cache, P sends only the pages after D's cached prefix). Every server: `--num-threads 1`, EAGLE-3
(`--speculative-algorithm eagle3 --draft-model default --spec-adaptive-pinned`). Requests go one at a
time; each step sends the same turn to the five configurations in a shuffled order, so the box's noise
falls on all alike (interleaved, paired).

Workloads, greedy, streamed /v1/chat/completions (usage included), at most --max-tokens tokens, EOS honoured:
  multi_turn     --conversations held-out ShareGPT conversations (specpd.train.data.is_held_out, file order)
                 with >= --turns human turns of at most --max-turn-tokens tokens each; turn k sends the
                 history (the user turns and the server's OWN previous replies as assistant messages, as a
                 chat client does) plus user turn k
  system_prompt  one ~--system-tokens-token system message (ShareGPT text) + --questions short distinct user
                 questions (first human turns of held-out conversations, <= 48 tokens)
The caches are flushed (POST /flush_cache) before each workload; the whole set runs --reps times.
TTFT = first streamed content token - send, client side. Per turn, the /server_info counters before and
after give: prompt tokens computed on P (prompt_tokens - prefix_cache_hit_tokens), on D (a short new turn D
prefilled itself: pd_local_prefills), on a unified server; P -> D KV bytes (P's kv_bytes) and pages, set
against the pages D's cache lacked (ceil(N / page) - D's cached pages). Hit rate = cached / prompt tokens
(usage.prompt_tokens_details.cached_tokens). tau = committed tokens per verify forward from each usage.

  python -m evals.prefix            # -> evals/results/prefix.json + prefix.png (~14 min)
  python -m evals.prefix --quick    # smoke, ~2-3 min -> $TMPDIR/specpd_prefix_quick.json
"""
from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile
import time

EVALS_DIR = os.path.dirname(os.path.abspath(__file__))
from evals.harness.prompts import real_text_prompts
from evals.harness.results import command_line, log, machine_info, versions, write_json
from evals.prefix_cluster import CONFIGS, FAILURES, cluster, flush, send, snapshot
from evals.prefix_report import plot, summarize

import httpx

RESULTS_DIR = os.path.join(EVALS_DIR, "results")


# -- workloads ---------------------------------------------------------------------------------------
def conversations(num: int, turns: int, max_turn_tokens: int, tokenizer) -> list[dict]:
    from specpd.train.data import is_held_out, iter_sharegpt
    out = []
    for record in iter_sharegpt():
        if not is_held_out(str(record.get("id"))):
            continue
        human = [t["value"] for t in record.get("conversations", []) if t.get("from") == "human"
                 and t.get("value", "").strip()]
        if len(human) < turns or any(len(tokenizer.encode(h, add_special_tokens=False)) > max_turn_tokens
                                     for h in human[:turns]):
            continue
        out.append({"id": record["id"], "turns": human[:turns]})
        if len(out) == num:
            return out
    raise RuntimeError(f"only {len(out)} held-out conversations fit")


def short_questions(num: int, tokenizer, skip_ids: set[str]) -> list[str]:
    from specpd.train.data import is_held_out, iter_sharegpt
    out = []
    for record in iter_sharegpt():
        if not is_held_out(str(record.get("id"))) or record.get("id") in skip_ids:
            continue
        human = [t["value"] for t in record.get("conversations", []) if t.get("from") == "human"]
        if human and 8 <= len(tokenizer.encode(human[0], add_special_tokens=False)) <= 48:
            out.append(human[0])
        if len(out) == num:
            return out
    raise RuntimeError(f"only {len(out)} short questions")


def run_multi_turn(client, targets, convs, max_tokens, rng, rep) -> list[dict]:
    rows = []
    for ci, conv in enumerate(convs):
        history = {name: [] for name in CONFIGS}
        for ti, user in enumerate(conv["turns"]):
            for name in rng.sample(CONFIGS, len(CONFIGS)):
                history[name].append({"role": "user", "content": user})
                row = send(client, name, targets[name], history[name], max_tokens)
                history[name].append({"role": "assistant", "content": row["text"]})  # the server's own reply
                rows.append({"config": name, "rep": rep, "conversation": ci, "turn": ti + 1, **row})
            t = {r["config"]: r for r in rows[-len(CONFIGS):]}
            log(f"   conv {ci} turn {ti + 1} prompt {t['unified_off']['prompt_tokens']:5d}  TTFT " +
                "  ".join(f"{n} {t[n]['ttft_s']:.2f}" for n in CONFIGS) +
                f"  cached U {t['unified_on']['cached_tokens']} PD {t['pd_on']['cached_tokens']}"
                f"{' (D local)' if t['pd_on']['local_prefill'] else ''}  pd_on_p: P computed "
                f"{t['pd_on_p']['computed_p']}, sent {t['pd_on_p']['kv_bytes'] / 1e6:.1f} MB")
    return rows


def run_system_prompt(client, targets, system, questions, max_tokens, rng, rep) -> list[dict]:
    rows = []
    for qi, q in enumerate(questions):
        for name in rng.sample(CONFIGS, len(CONFIGS)):
            msgs = [{"role": "system", "content": system}, {"role": "user", "content": q}]
            rows.append({"config": name, "rep": rep, "turn": qi + 1,
                         **send(client, name, targets[name], msgs, max_tokens)})
        t = {r["config"]: r for r in rows[-len(CONFIGS):]}
        log(f"   question {qi + 1} prompt {t['unified_off']['prompt_tokens']}  TTFT " +
            "  ".join(f"{n} {t[n]['ttft_s']:.2f}" for n in CONFIGS))
    return rows


# -- main --------------------------------------------------------------------------------------------
def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--conversations", type=int, default=3)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--max-turn-tokens", type=int, default=512)
    ap.add_argument("--questions", type=int, default=4)
    ap.add_argument("--system-tokens", type=int, default=1000)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--out", default=None)
    ap.add_argument("--replot", metavar="JSON", help="only redraw the figure of an earlier run's results")
    args = ap.parse_args()
    if args.replot:
        with open(args.replot) as f:
            rows = json.load(f)["rows"]
        plot(os.path.splitext(args.replot)[0] + ".png", rows["multi_turn"], rows["system_prompt"])
        return 0
    if args.quick:
        args.conversations, args.turns, args.questions, args.max_tokens, args.reps = 1, 3, 2, 16, 1
        args.system_tokens = 300
    out_path = args.out or (os.path.join(tempfile.gettempdir(), "specpd_prefix_quick.json") if args.quick
                            else os.path.join(RESULTS_DIR, "prefix.json"))
    meta = {"versions": versions(), "machine": machine_info()}
    from specpd.model.loader import load_checkpoint
    tok = load_checkpoint("default").tokenizer
    convs = conversations(args.conversations, args.turns, args.max_turn_tokens, tok)
    questions = short_questions(args.questions, tok, {c["id"] for c in convs})
    (system_ids,), source = real_text_prompts(tok, 1, args.system_tokens)
    system = tok.decode(system_ids)
    engine_args = ["--model", "default", "--num-threads", "1", "--speculative-algorithm", "eagle3",
                   "--draft-model", "default", "--spec-adaptive-pinned"]
    rng = random.Random(0)
    t_start = time.perf_counter()
    rows_mt, rows_sp = [], []
    with cluster(engine_args) as targets, httpx.Client(timeout=httpx.Timeout(600.0)) as client:
        log(f"servers up in {time.perf_counter() - t_start:.0f} s")
        for name, target in targets.items():  # first-request costs out of the measurement
            send(client, name, target, [{"role": "user", "content": "Say hello."}], 8)
        page_size = snapshot(targets["unified_on"])["unified"]["page_size"]
        for rep in range(args.reps):
            log(f"== rep {rep}: multi-turn")
            flush(client, targets)
            rows_mt += run_multi_turn(client, targets, convs, args.max_tokens, rng, rep)
            log(f"== rep {rep}: shared system prompt")
            flush(client, targets)
            rows_sp += run_system_prompt(client, targets, system, questions, args.max_tokens, rng, rep)
            pages_back = {f"{n}/{role}": (i["free_pages"] == i["total_pages"])
                          for n, t in targets.items() for role, i in snapshot(t).items()}
            report = build_report(args, rows_mt, rows_sp, convs, system_ids, source, questions, engine_args,
                                  page_size, pages_back, tok, t_start, meta)
            write_json(out_path, report)  # after every rep: a run cut short keeps what it measured
    plot(os.path.splitext(out_path)[0] + ".png", rows_mt, rows_sp)
    for wl in ("multi_turn", "system_prompt"):
        log(f"{wl}: {json.dumps(report[wl]['ratios'], indent=1)}")
        for name, s in report[wl]["configs"].items():
            log(f"  {name}: TTFT turn1 p50 {s['ttft_turn1_p50_s']:.2f}  later p50 {s['ttft_later_p50_s']:.2f} "
                f"p99 {s['ttft_later_p99_s']:.2f}  hit {s['hit_rate']:.2f}  tau {s['tau']}")
    log(f"wrote {out_path} in {report['bench_wall_s']} s")
    return 0


def build_report(args, rows_mt, rows_sp, convs, system_ids, source, questions, engine_args, page_size, pages_back,
                 tok, t_start, meta) -> dict:
    # bytes of one page P sends (target + draft pools), from a turn without the cache
    off = next(r for r in rows_mt if r["config"] == "pd_off")
    page_bytes = off["kv_bytes"] // -(-off["prompt_tokens"] // page_size)
    return {"benchmark": "prefix", "description": __doc__.split("\n\n")[0], "command": command_line(),
            "model": "default (SmolLM2-135M-Instruct)", "engine_args": engine_args, "page_size": page_size,
            "kv_page_bytes": page_bytes, "max_tokens": args.max_tokens, "reps": args.reps,
            "conversations": [{"id": c["id"], "turn_tokens": [len(tok.encode(t, add_special_tokens=False))
                                                               for t in c["turns"]]} for c in convs],
            "system_prompt_tokens": len(system_ids), "system_prompt_source": source,
            "questions": questions, "pages_back_to_total": pages_back, "failed_and_resent": FAILURES,
            "reps_done": 1 + max(r["rep"] for r in rows_mt),
            "multi_turn": summarize(rows_mt, page_bytes, page_size),
            "system_prompt": summarize(rows_sp, page_bytes, page_size),
            "rows": {"multi_turn": [{k: v for k, v in r.items() if k != "text"} for r in rows_mt],
                     "system_prompt": [{k: v for k, v in r.items() if k != "text"} for r in rows_sp]},
            "bench_wall_s": round(time.perf_counter() - t_start, 1), **meta}


if __name__ == "__main__":
    sys.exit(main())
