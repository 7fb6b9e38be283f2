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

  python evals/bench_prefix.py            # -> evals/results/prefix.json + prefix.png (~14 min)
  python evals/bench_prefix.py --quick    # smoke, ~2-3 min -> $TMPDIR/specpd_prefix_quick.json
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import sys
import tempfile
import time

EVALS_DIR = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(EVALS_DIR)
sys.path[:0] = [EVALS_DIR, REPO]
from common import log, machine_info, percentile, real_text_prompts, versions, write_json  # noqa: E402

import httpx  # noqa: E402

from specpd.server.launch import free_port, serve_processes  # noqa: E402

RESULTS_DIR = os.path.join(EVALS_DIR, "results")
CONFIGS = ("unified_on", "unified_off", "pd_on", "pd_off", "pd_on_p")
# on / off pairs compared; pd_on_p: D never prefills locally (--pd-local-prefill-tokens 0), so every turn goes
# through P's own cache and P sends the pages after D's cached prefix
PAIRS = {"unified": ("unified_on", "unified_off"), "pd": ("pd_on", "pd_off"), "pd_p": ("pd_on_p", "pd_off")}
COUNTERS = ("prompt_tokens", "prefix_cache_hit_tokens", "prefix_cache_query_tokens", "kv_bytes", "kv_transfers",
            "prefills_skipped", "pd_local_prefills", "spec_verify_count")


# -- servers -----------------------------------------------------------------------------------------
@contextlib.contextmanager
def cluster(engine_args: list[str]):
    """Every configuration up at once; yields {config: {"url", "servers": {role: url}}}."""
    off = ["--disable-prefix-caching"]
    boot_on, boot_off, boot_p = free_port(), free_port(), free_port()
    specs = [(["--role", "unified", *engine_args], None), (["--role", "unified", *engine_args, *off], None),
             (["--role", "prefill", "--bootstrap-port", str(boot_on), *engine_args], "0"),
             (["--role", "decode", *engine_args], "1"),
             (["--role", "prefill", "--bootstrap-port", str(boot_off), *engine_args, *off], "0"),
             (["--role", "decode", *engine_args, *off], "1"),
             (["--role", "prefill", "--bootstrap-port", str(boot_p), *engine_args], "0"),
             (["--role", "decode", "--pd-local-prefill-tokens", "0", *engine_args], "1")]
    env = {"MC_LOG_LEVEL": "ERROR"}
    with serve_processes([["--log-level", "warning", *a] for a, _ in specs], 900, cpus=[c for _, c in specs],
                         env=env) as procs:
        uon, uoff, p_on, d_on, p_off, d_off, p_p, d_p = [base for _, base, _ in procs]
        routers = [["--role", "router", "--prefill", p, "--decode", d, "--bootstrap-port", str(b)]
                   for p, d, b in ((p_on, d_on, boot_on), (p_off, d_off, boot_off), (p_p, d_p, boot_p))]
        with serve_processes([["--log-level", "warning", *a] for a in routers], 300, env=env) as rprocs, \
                keep_logs({n: path for n, (_, _, path) in zip(
                    ("unified_on", "unified_off", "pd_on/prefill", "pd_on/decode", "pd_off/prefill", "pd_off/decode",
                     "pd_on_p/prefill", "pd_on_p/decode", "pd_on/router", "pd_off/router", "pd_on_p/router"),
                    procs + rprocs)}):
            r_on, r_off, r_p = [base for _, base, _ in rprocs]
            yield {"unified_on": {"url": uon, "servers": {"unified": uon}},
                   "unified_off": {"url": uoff, "servers": {"unified": uoff}},
                   "pd_on": {"url": r_on, "servers": {"prefill": p_on, "decode": d_on}},
                   "pd_off": {"url": r_off, "servers": {"prefill": p_off, "decode": d_off}},
                   "pd_on_p": {"url": r_p, "servers": {"prefill": p_p, "decode": d_p}}}


@contextlib.contextmanager
def keep_logs(paths: dict[str, str]):
    """Every server's log tail on stderr if the run fails (serve_processes deletes the logs)."""
    try:
        yield
    except BaseException:
        for name, path in paths.items():
            with open(path) as f:
                log(f"---- {name} log tail:\n" + f.read()[-3000:])
        raise


def snapshot(target: dict) -> dict:
    return {role: httpx.get(url + "/server_info", timeout=30).json() for role, url in target["servers"].items()}


def deltas(before: dict, after: dict) -> dict:
    return {role: {k: (after[role].get(k) or 0) - (before[role].get(k) or 0) for k in COUNTERS} for role in after}


def wait_idle(target: dict, timeout_s: float = 30) -> None:
    """Until every server of the target holds no request (free + cached-unreferenced = total)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        infos = snapshot(target)
        if all(i["free_pages"] == i["total_pages"] for i in infos.values()):
            return
        time.sleep(0.05)
    log(f"   pages not back after {timeout_s} s: {target['servers']}")


# -- client ------------------------------------------------------------------------------------------
def chat(client: httpx.Client, url: str, messages: list[dict], max_tokens: int) -> dict:
    body = {"messages": messages, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}, "logprobs": True, "top_logprobs": 0}
    t0 = time.perf_counter()
    first = last = None
    text, n, usage = [], 0, None
    with client.stream("POST", url + "/v1/chat/completions", json=body) as resp:
        if resp.status_code != 200:
            return {"error": f"{resp.status_code}: {resp.read()[:300]!r}"}
        for line in resp.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                return {"error": str(chunk["error"])}
            usage = chunk.get("usage") or usage
            for choice in chunk.get("choices", []):
                got = ((choice.get("logprobs") or {}).get("content")) or []
                text.append(choice.get("delta", {}).get("content") or "")
                if got:
                    now = time.perf_counter()
                    first = first if first is not None else now
                    last, n = now, n + len(got)
    return {"ttft_s": first - t0, "e2e_s": last - t0, "text": "".join(text), "completion_tokens": n,
            "usage": usage}


FAILURES: list[dict] = []  # requests that failed and were sent again (a loaded box: see the README)


def send(client: httpx.Client, name: str, target: dict, messages: list[dict], max_tokens: int) -> dict:
    for attempt in range(2):
        before = snapshot(target)
        try:
            row = chat(client, target["url"], messages, max_tokens)
        except httpx.HTTPError as e:
            row = {"error": repr(e)}
        if "error" not in row:
            break
        log(f"   {name}: request failed ({row['error'][:200]}); {'again' if attempt == 0 else 'giving up'}")
        FAILURES.append({"config": name, "error": row["error"][:500], "at": time.strftime("%H:%M:%S")})
        wait_idle(target)
    else:
        raise RuntimeError(f"{name}: {row['error']}")
    wait_idle(target)  # P's transfer counters settle once its room is freed
    d = deltas(before, snapshot(target))
    usage = row["usage"]
    n, cached = usage["prompt_tokens"], usage["prompt_tokens_details"]["cached_tokens"]
    row.update(prompt_tokens=n, cached_tokens=cached, counters=d)
    if "unified" in d:
        row["computed_unified"] = d["unified"]["prompt_tokens"] - d["unified"]["prefix_cache_hit_tokens"]
    else:
        p, dd = d["prefill"], d["decode"]
        row["computed_p"] = p["prompt_tokens"] - p["prefix_cache_hit_tokens"]
        row["local_prefill"] = bool(dd["pd_local_prefills"])
        # D's engine counts the hit of a request it prefills itself; a prebuilt one's hit is D's cached prefix
        row["d_cached_tokens"] = dd["prefix_cache_hit_tokens"]
        row["computed_d"] = n - dd["prefix_cache_hit_tokens"] if row["local_prefill"] else 0
        row["kv_bytes"] = p["kv_bytes"]
    return row


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


def flush(client, targets) -> None:
    for target in targets.values():
        resp = client.post(target["url"] + "/flush_cache")
        assert resp.status_code == 200, resp.text


# -- summary -----------------------------------------------------------------------------------------
def tau(rows: list[dict]) -> float | None:
    verify = sum((r["usage"].get("spec_verify_count") or 0) for r in rows)
    committed = sum((r["usage"].get("spec_accept_length") or 0) * (r["usage"].get("spec_verify_count") or 0)
                    for r in rows)
    return committed / verify if verify else None


def summarize(rows: list[dict], page_bytes: int | None, page_size: int) -> dict:
    out = {}
    for name in CONFIGS:
        mine = [r for r in rows if r["config"] == name]
        later = [r for r in mine if r["turn"] >= 2]
        first = [r for r in mine if r["turn"] == 1]
        t_later, t_first = [r["ttft_s"] for r in later], [r["ttft_s"] for r in first]
        prompt = sum(r["prompt_tokens"] for r in mine)
        s = {"requests": len(mine), "ttft_turn1_p50_s": percentile(t_first, 0.5),
             "ttft_turn1_p99_s": percentile(t_first, 0.99), "ttft_later_p50_s": percentile(t_later, 0.5),
             "ttft_later_p99_s": percentile(t_later, 0.99), "prompt_tokens": prompt,
             "cached_tokens": sum(r["cached_tokens"] for r in mine),
             "hit_rate": sum(r["cached_tokens"] for r in mine) / prompt,
             "hit_rate_later": sum(r["cached_tokens"] for r in later) / max(1, sum(r["prompt_tokens"] for r in later)),
             "tau": tau(mine), "completion_tokens": sum(r["completion_tokens"] for r in mine)}
        if name.startswith("unified"):
            s["computed_tokens"] = sum(r["computed_unified"] for r in mine)
            s["computed_tokens_later"] = sum(r["computed_unified"] for r in later)
        else:
            s["computed_p"] = sum(r["computed_p"] for r in mine)
            s["computed_d"] = sum(r["computed_d"] for r in mine)
            s["computed_p_later"] = sum(r["computed_p"] for r in later)
            s["computed_d_later"] = sum(r["computed_d"] for r in later)
            s["d_local_prefills"] = sum(r["local_prefill"] for r in mine)
            s["kv_bytes"] = sum(r["kv_bytes"] for r in mine)
            s["kv_bytes_per_turn_later_mean"] = sum(r["kv_bytes"] for r in later) / max(1, len(later))
            if page_bytes:
                # P should send only the pages D's cache lacked: none for a turn D prefilled itself
                want = [0 if r["local_prefill"] else -(-r["prompt_tokens"] // page_size) - r["d_cached_tokens"] // page_size
                        for r in mine]
                got = [r["kv_bytes"] / page_bytes for r in mine]
                s["kv_pages_sent"], s["kv_pages_d_lacked"] = sum(got), sum(want)
                s["kv_sent_only_lacking_pages"] = all(abs(g - w) < 1e-6 for g, w in zip(got, want))
        out[name] = s
    ratios = {}
    for kind, (on_name, off_name) in PAIRS.items():
        on, off = out[on_name], out[off_name]
        on_rows = {(r["rep"], r.get("conversation"), r["turn"]): r for r in rows if r["config"] == on_name}
        paired = sorted(on_rows[(r["rep"], r.get("conversation"), r["turn"])]["ttft_s"] / r["ttft_s"]
                        for r in rows if r["config"] == off_name and r["turn"] >= 2)
        ratios[kind] = {"ttft_later_p50_on_over_off": on["ttft_later_p50_s"] / off["ttft_later_p50_s"],
                        "ttft_later_p99_on_over_off": on["ttft_later_p99_s"] / off["ttft_later_p99_s"],
                        "ttft_turn1_p50_on_over_off": on["ttft_turn1_p50_s"] / off["ttft_turn1_p50_s"],
                        "paired_turn_ratio": {"min": paired[0], "p25": percentile(paired, 0.25),
                                              "median": percentile(paired, 0.5), "p75": percentile(paired, 0.75),
                                              "max": paired[-1], "n": len(paired)},
                        "tau_on_over_off": (on["tau"] / off["tau"]) if on["tau"] and off["tau"] else None}
        same = [r["text"] == o["text"] for r in rows if r["config"] == off_name
                for o in [on_rows[(r["rep"], r.get("conversation"), r["turn"])]]]
        ratios[kind]["same_replies_on_off"] = f"{sum(same)}/{len(same)}"
    reps = sorted({r["rep"] for r in rows})
    if len(reps) > 1:  # the spread of the headline ratio over whole passes
        for kind, pair in PAIRS.items():
            per_rep = []
            for rep in reps:
                med = [percentile([r["ttft_s"] for r in rows if r["config"] == c and r["rep"] == rep and r["turn"] >= 2], 0.5)
                       for c in pair]
                per_rep.append(med[0] / med[1])
            ratios[kind]["ttft_later_p50_ratio_per_rep"] = per_rep
    return {"configs": out, "ratios": ratios}


def plot(path: str, rows_mt: list[dict], rows_sp: list[dict]) -> None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        log("matplotlib not installed: no plot")
        return
    colors = {"unified_on": "tab:blue", "unified_off": "tab:blue", "pd_on": "tab:orange", "pd_off": "tab:orange",
              "pd_on_p": "tab:red"}
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    turns = sorted({r["turn"] for r in rows_mt})
    for name in CONFIGS:
        kind, on = name.split("_")[:2]
        style = "-" if on == "on" else "--"
        marker = "^" if name == "pd_on_p" else {"unified": "o", "pd": "s"}[kind]
        ttft = [percentile([r["ttft_s"] for r in rows_mt if r["config"] == name and r["turn"] == t], 0.5) for t in turns]
        axes[0].plot(turns, ttft, style, marker=marker, color=colors[name], label=name,
                     markerfacecolor="none" if on == "off" else None)
        comp = [percentile([r.get("computed_unified", r.get("computed_p", 0) + r.get("computed_d", 0))
                            for r in rows_mt if r["config"] == name and r["turn"] == t], 0.5) for t in turns]
        axes[2].plot(turns, comp, style, marker=marker, color=colors[name], label=name,
                     markerfacecolor="none" if on == "off" else None)
    axes[0].set(title="multi-turn chat: TTFT by turn (median)", xlabel="turn", ylabel="TTFT (s)", xticks=turns)
    axes[2].set(title="prompt tokens computed (P + D) by turn (median)", xlabel="turn", ylabel="tokens", xticks=turns)
    for ax in (axes[0], axes[2]):
        ax.legend()
        ax.grid(alpha=0.3)
    xs = range(len(CONFIGS))
    cold = [percentile([r["ttft_s"] for r in rows_sp if r["config"] == n and r["turn"] == 1], 0.5) for n in CONFIGS]
    warm = [percentile([r["ttft_s"] for r in rows_sp if r["config"] == n and r["turn"] >= 2], 0.5) for n in CONFIGS]
    axes[1].bar([x - 0.2 for x in xs], cold, 0.4, label="question 1 (cold)", color="tab:gray")
    axes[1].bar([x + 0.2 for x in xs], warm, 0.4, label="questions >= 2 (median)", color="tab:green")
    axes[1].set_xticks(list(xs), [n.replace("_on_p", "_on\nP path") for n in CONFIGS])
    axes[1].set(title="shared system prompt: TTFT", ylabel="TTFT (s)", ylim=(0, 1.3 * max(cold + warm)))
    axes[1].legend(loc="upper center", ncol=2, fontsize="small")
    axes[1].grid(alpha=0.3, axis="y")
    fig.suptitle("specpd prefix caching, EAGLE-3, 1 thread per server (2 shared CPU cores)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    log(f"wrote {path}")


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
    return {"benchmark": "prefix", "description": __doc__.split("\n\n")[0], "command": "python " + " ".join(sys.argv),
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
