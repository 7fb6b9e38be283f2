"""What evals/soak.py makes of its records: outcome counts, TTFT / TPOT percentiles, and the RSS and outcome plot.
"""
from __future__ import annotations


def pct(xs: list[float]) -> dict:
    """Nearest-rank percentiles (the value at index int(q * n)), not common.percentile's interpolated ones:
    soak.json's figures are read this way."""
    xs = sorted(xs)
    if not xs:
        return {"count": 0}
    pick = lambda q: xs[min(len(xs) - 1, int(q * len(xs)))]  # noqa: E731
    return {"count": len(xs), "p50": round(pick(0.5), 4), "p90": round(pick(0.9), 4), "p99": round(pick(0.99), 4),
            "max": round(xs[-1], 4)}


def summarize(records: list[dict]) -> dict:
    from collections import Counter
    by = Counter(r.get("outcome", "unfinished") for r in records)
    failed = Counter(r["reason"] for r in records if r.get("outcome") == "failed")
    expected = Counter(f"{r['kind']}: {r['reason']}" for r in records if r.get("outcome") == "expected")
    lost = [r for r in records if r.get("outcome") in ("lost", None)]
    ok = [r for r in records if r.get("outcome") == "completed" and r["kind"] in ("ok", "abort")]
    streamed = [r for r in ok if r.get("stream")]
    return {
        "sent": len(records), "completed": by["completed"], "expected_refusals": by["expected"],
        "failed": by["failed"], "lost": len(lost), "by_kind": dict(Counter(r["kind"] for r in records)),
        "failed_by_reason": dict(failed.most_common()), "expected_by_reason": dict(expected.most_common()),
        "lost_requests": [{k: r.get(k) for k in ("kind", "t_start", "long", "stream", "reason")} for r in lost],
        "completed_long": sum(1 for r in ok if r.get("long")), "completed_streamed": len(streamed),
        "completion_tokens": sum(r.get("completion_tokens", 0) for r in ok),
        "ttft_s": pct([r["ttft_s"] for r in streamed if "ttft_s" in r]),
        "ttft_s_short": pct([r["ttft_s"] for r in streamed if "ttft_s" in r and not r.get("long")]),
        "ttft_s_long": pct([r["ttft_s"] for r in streamed if "ttft_s" in r and r.get("long")]),
        "tpot_s": pct([r["tpot_s"] for r in streamed if "tpot_s" in r]),
        "e2e_s_non_streamed": pct([r["e2e_s"] for r in ok if not r.get("stream") and "e2e_s" in r]),
    }


def plot(path: str, rss_samples: list[dict], records: list[dict], warmup_t: float, load_end: float) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, (a1, a2) = plt.subplots(2, 1, figsize=(10, 7), sharex=True)
    a1b = a1.twinx()  # P and D (GiB-sized) on the left, the router and launcher (tens of MiB) on the right
    for (role, color), ax in zip((("prefill", "tab:blue"), ("decode", "tab:orange"), ("router", "tab:green"),
                                  ("launcher", "tab:purple")), (a1, a1, a1b, a1b)):
        pts = [(s["t"], s[role]["rss_mb"]) for s in rss_samples if role in s and s[role]["rss_mb"] is not None]
        if pts:
            ax.plot([p[0] / 60 for p in pts], [p[1] for p in pts], marker=".", color=color, label=role)
    a1.set_ylabel("VmRSS (MiB): prefill, decode")
    a1b.set_ylabel("VmRSS (MiB): router, launcher")
    h1, l1 = a1.get_legend_handles_labels()
    h2, l2 = a1b.get_legend_handles_labels()
    a1.legend(h1 + h2, l1 + l2, loc="center right")
    a1.set_title("specpd 1P1D EAGLE-3 soak: RSS per process")
    for ax in (a1, a2):
        ax.axvline(warmup_t / 60, color="grey", ls="--", lw=0.8)
        ax.axvline(load_end / 60, color="black", ls=":", lw=0.8)
    bin_s = 30.0
    n_bins = int(max([r.get("t_end", r["t_start"]) for r in records] + [load_end]) // bin_s) + 1
    cats = [("completed", "tab:green"), ("expected", "tab:blue"), ("failed", "tab:red"), ("lost", "black")]
    bottom = [0] * n_bins
    xs = [(i * bin_s + bin_s / 2) / 60 for i in range(n_bins)]
    for cat, color in cats:
        counts = [0] * n_bins
        for r in records:
            if r.get("outcome", "lost") == cat:
                counts[int(r.get("t_end", r["t_start"]) // bin_s)] += 1
        a2.bar(xs, counts, width=bin_s / 60 * 0.9, bottom=bottom, color=color, label=cat)
        bottom = [b + c for b, c in zip(bottom, counts)]
    a2.set_ylabel(f"requests ended per {bin_s:.0f} s")
    a2.set_xlabel("minutes since load start (dashed: end of warm-up, dotted: deadline)")
    a2.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
