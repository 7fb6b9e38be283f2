"""What evals/prefix.py makes of its rows: per configuration TTFT (first turn, later turns), hit rate,
tokens computed on P and D, KV pages sent against the pages D lacked, tau; on / off ratios; the figure.
"""
from __future__ import annotations

from evals.harness.results import log, percentile
from evals.prefix_cluster import CONFIGS, PAIRS


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
