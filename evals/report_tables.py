"""The Markdown table evals/report.py prints for each benchmark's canonical result file: one function per
benchmark, taking the file's JSON; the cells carry medians with their min-max spread where the file has them."""
from __future__ import annotations


def _f(x, p=2, suffix=""):
    return "–" if x is None else f"{x:.{p}f}{suffix}"


def _spread(x, p=2):
    return f" ({_f(x[0], p)}–{_f(x[1], p)})" if x else ""


def _table(header: list[str], rows: list[list]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


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
    pairs = d.get("pairs", {}).get("specpd/eagle3/bf16", {})  # rep by rep (bench_peers --paired), where recorded
    for key in plain:
        field = "tpot_p50_ms" if key.endswith("/c1") else "output_tok_s"
        if key in pairs:
            name = "tpot_speedup" if field == "tpot_p50_ms" else "tok_s_ratio"
            ratio = _f(pairs[key][name], 2, "×") + _spread(pairs[key][name + "_spread"])
        else:
            ratio = _f(plain[key][field] / spec[key][field] if field == "tpot_p50_ms"
                       else spec[key][field] / plain[key][field], 2, "×")
        pair = pairs.get(key, {})
        pooled = "–" if "tpot_speedup_pooled" not in pair else (
            _f(pair["tpot_speedup_pooled"], 2, "×") + f" / {_f(pair['tpot_speedup_by_prompt'], 2, '×')}"
            + _spread(pair["tpot_speedup_by_prompt_10_90"]) + f" ({pair['pooled_requests']} requests)")
        rows.append([key, _f(plain[key][field], 1) + _spread(plain[key][field + "_spread"], 1),
                     _f(spec[key][field], 1) + _spread(spec[key][field + "_spread"], 1), ratio, pooled,
                     _f(spec[key]["tau"]), _percent(spec[key].get("depth0_share"))])
    return _table(["cell", "plain (TPOT ms at c1, tok/s above)", "eagle3 defaults",
                   "eagle3 over plain (median of the reps' pairs where paired)",
                   "c1, every rep's requests: TPOT p50 over p50 / prompt by prompt (10–90%)", "τ",
                   "rounds at depth 0"], rows)


def _percent(x) -> str:
    return "–" if x is None else f"{x:.0%}"


def hf_generate(d: dict) -> str:
    rows = [[name, _f(c["specpd_decode_tok_s"], 1), _f(c["hf_decode_tok_s"], 1),
             _f(c["ratio_median"], 2, "×") + _spread(c["ratio_spread"], 2),
             f"{c['greedy_tokens_equal']} / {c['prompts']}"]
            for name, c in d["dtypes"].items()]
    return _table(["dtype", "specpd decode tok/s", "HF generate tok/s", "specpd over HF (per prompt)",
                   "greedy tokens equal"], rows)


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


def bench_mtp_pd(d: dict) -> str:
    rows = [[name, _f(r.get("tau")), _f((r.get("ttft_p50_s") or 0) * 1e3, 0), _f((r.get("tpot_p50_s") or 0) * 1e3, 1),
             _f((r.get("tpot_p99_s") or 0) * 1e3, 1), "yes" if r.get("same_tokens_as_unified_plain") else "NO",
             r.get("num_errors", "–")] for name, r in d["configs"].items()]
    m = d["model"]
    return (f"{m['parameters'] / 1e6:.0f}M parameters + a {m['mtp_parameters'] / 1e6:.0f}M MTP layer, "
            f"{d['workload']['prompts']} prompts of {d['workload']['prompt_len']} tokens, "
            f"{d['workload']['max_tokens']} new tokens, c1.\n\n"
            + _table(["config", "τ", "TTFT p50 ms", "TPOT p50 ms", "TPOT p99 ms", "tokens = plain", "errors"], rows))


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


def gemm_kernel(d: dict) -> str:
    rows = [[m, _f(c["current_ms"], 2), _f(c["against_ms"], 2),
             _f(c["speedup"], 3, "×") + f" ({_f(c['speedup_iqr'][0], 3)}–{_f(c['speedup_iqr'][1], 3)})",
             _f(c["read_gb_s"], 1), c["bit_identical"]] for m, c in d["rows"].items()]
    return _table(["rows", "ms (30 layers' linears)", f"ms at {d['args']['against']}", "speed-up (IQR)",
                   "weights read GB/s", "bit-identical"], rows)


def profile_step(d: dict) -> str:
    rows = []
    for name, c in d["cases"].items():
        py = c.get("per_layer_python_path", c)  # where the C stack ran, its parts come from the per-layer path
        over = c.get("step_over_floor", c["step_ms"] / c["floor_ms"])  # paired with each step's own bandwidth read
        rows.append([name, _f(c["step_ms"], 1), _f(c["floor_ms"], 1),
                     _f(over, 2, "×") + _spread(c.get("step_over_floor_range")),
                     _f(py["step_ms"], 1) if py is not c else "–", _f(py["gemm_ms"], 1), _f(py["attention_ms"], 1)])
    return _table(["case", "step ms", "floor ms (median read)", "over the floor (10–90%)", "per-layer path step ms",
                   "its GEMMs ms", "its attention ms"], rows)


def profile_spec_round(d: dict) -> str:
    rows = [[name, _f(e["tok_s_over_plain"], 3, "×"),
             _f(e["per_prompt_median"], 3, "×") + _spread(e["per_prompt_10_90"], 3), _f(e["ms_per_token"], 2),
             _f(e["tokens_per_round"], 2)] for name, e in d["engines"].items()]
    r = d["round"]
    p, f = r["plain_step_ms"], r["fixed_round_ms"]
    parts = ", ".join(f"{k.replace('_', ' ')} {_f(v, 2)}" for k, v in f.items() if k != "round")
    fwd = ", ".join(f"{k} {_f(v['forward_ms'], 1)} ms ({_f(v['over_1_row'], 2, '×')}"
                    + (f"; best {_f(v['forward_ms_best'], 1)} ms, {_f(v['best_over_1_row'], 2, '×')}"
                       if "forward_ms_best" in v else "") + ")"
                    for k, v in d["forward_by_rows"].items())
    return (_table(["engine (b1, held-out chat)", "tok/s over plain", "per prompt, median (10–90%)", "ms per token",
                    "tokens per round"], rows)
            + f"\n\nA plain step {_f(p['step'], 2)} ms (model {_f(p['model_forward'], 2)}, LM head and sampling "
            f"{_f(p['lm_head_and_sampling'], 2)}); a full-tree round {_f(f['round'], 2)} ms = "
            f"{_f(r['round_over_plain_step'], 2, '×')} a step ({parts}); ceiling at its tokens per round "
            f"{_f(r['ceiling_tok_s_over_plain'], 2, '×')}. The target's forward by query rows: {fwd}.")


def profile_depth0(d: dict) -> str:
    rows = []
    for name, c in d["configs"].items():
        r, ms = sorted(c["ratio_vs_non_spec"]), c["ms_per_step"]
        rows.append([name, _f(r[len(r) // 2], 3, "×") + _spread([r[0], r[-1]], 3), _f(ms["step"], 1),
                     _f(ms.get("draft_extend"), 2), _f(ms.get("policy_plan"), 2), _f(c.get("rounds_off_share"))])
    rate = "tok/s (closed loop)" if d["meta"]["args"].get("closed_loop") else "decode tok/s"
    return _table(["config", f"{rate} vs non-spec", "step ms", "draft extends ms", "policy ms",
                   "share of rounds at depth 0"], rows)


def overlap(d: dict) -> str:
    rows = [[work, _f(c["step_ms"]["none"], 2), _f(c["step_ms"]["serial"], 2), _f(c["step_ms"]["overlap"], 2),
             _f(c["hidden_share"], 2)] for work, c in d["cases"].items()]
    return _table(["host work a step", "step ms, none", "after the step", "beside the next step",
                   "share of the work hidden"], rows)


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
    if "targets" in d:  # gpu.py since CUDA graphs: issue 67's targets, each judged
        rows = [[name, t["target"], _f(t["measured"], 2) if isinstance(t["measured"], float) else t["measured"],
                 {True: "yes", False: "no", None: "not measured"}[t["met"]]] for name, t in d["targets"].items()]
        return _table(["target", "bound", "measured", "met"], rows)
    rows = [[k, _f(v["tpot_ms"], 1), _f(v.get("tau")), _f(v.get("tok_s_over_plain"), 2, "×"),
             v.get("greedy_equals_plain", "–")] for k, v in {**d["plain"], **d["spec"]}.items()]
    return _table(["dtype/backend/config/batch", "TPOT ms", "τ", "over plain", "greedy equals plain"], rows)


def pd_load(d: dict) -> str:
    """This commit's run, then the other runs the file keeps (pd_load.py's --merge), each with its code path."""
    runs = [(d.get("label") or "this run", d)] + [(k, d[k]) for k in sorted(d) if isinstance(d[k], dict)
                                                  and "cases" in d[k] and "isa" in d[k]]
    rows = []
    for name, run in runs:
        path = "AVX2 forced" if run.get("forced") else run["isa"]
        for c in run["cases"]:
            rows.append([name, path, f"{c['requests']} ({c['long_requests']} long)", c["busy_loops"],
                         f"**{c['failed']}**", _f(c["wall_s"], 0), "yes" if c["pages_back"] else "**no**",
                         "; ".join(e[:90] for e in c["errors"]) or "–"])
    return _table(["run", "code path", "requests", "busy loops", "failed", "wall s", "pages back on P and D",
                   "errors"], rows)


def peers_model_shape(d: dict) -> str:
    """peers at another model shape (--model-shape): the peers table, then c1 TPOT over the fp32 weights' read
    floor measured beside it."""
    floor = d.get("floor") or {}
    rows = [[name, _f(ratio.get("chat/c1"))] for name, ratio in sorted(floor.get("c1_tpot_p50_over_floor", {}).items())]
    note = (f"\n\nRead floor: {_f((d.get('weight_bytes_fp32') or 0) / 1e6, 0)} MB of fp32 weights at "
            f"{_f(floor.get('read_gb_s_median'), 1)} GB/s{_spread(floor.get('read_gb_s_range'), 1)} = "
            f"{_f(floor.get('floor_ms'), 1)} ms a token\n\n")
    return peers(d) + note + _table(["server", "c1 TPOT p50 over the floor"], rows)


def gemm_q(d: dict) -> str:
    """kernels_gemm_q.json: ms per step's linears by rows, at the most threads timed."""
    top = max(r["threads"] for r in d["results"])
    results = [r for r in d["results"] if r["threads"] == top]
    paths = list(results[0]["ms"])
    return _table(["rows", *paths, "floor (gguf bytes)"],
                  [[r["rows"], *(_f(r["ms"].get(p)) for p in paths),
                    _f(r["floor_ms"].get("gguf (Q4_1 + Q8_0 head)"))] for r in results])


def engine_quant(d: dict) -> str:
    """engine_quant.json: resident memory per weight format, and agreement with the dense fp32 engine."""
    mem = _table(["quantization", "dtype", "RSS after start MiB", "peak MiB"],
                 [[m["quantization"], m["dtype"], m["rss_started_mib"], m["peak_mib"]] for m in d["memory"]])
    agree = d["agreement"]["vs_reference"]
    return mem + "\n\n" + _table(["against dense fp32", "common-prefix share", "first token agrees", "identical"],
                                 [[k, _f(v["common_prefix_share"]), v["first_token_agrees"], v["identical_outputs"]]
                                  for k, v in agree.items()])


def q_rows(d: dict) -> str:
    """kernels_q_rows.json: one forward's linears by rows on the quantized kernel, and a row's cost against the
    VNNI floor."""
    rows = [[m, _f(r["ms"]) + _spread(r["ms_range"]), _f(r["over_1_row"])] for m, r in d["rows"].items()]
    head = (f"Marginal row {_f(d['marginal_ms_per_row'], 3)} ms; VNNI floor {_f(d.get('floor_ms_per_row'), 3)} ms "
            f"(the model's {d['weights']} weights / 64 multiply-adds a vpdpbusd / "
            f"{_f((d.get('vpdpbusd_per_s') or 0) / 1e9)} G vpdpbusd/s measured); marginal over floor "
            f"{_f(d.get('marginal_over_floor'))}\n\n")
    return head + _table(["rows", "ms (min–max)", "over 1 row"], rows)
