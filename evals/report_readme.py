"""The README's Results block, cut from evals/results/peers.json by evals/report.py: one table per peer
(vLLM's CPU build, llama.cpp on the same GGUF) and one for speculation over specpd's plain decoding, each
headed by the box and ISA the file records. A peer the file lacks gets a line saying so (with the reason the
run recorded, if any), never a stale figure; the rest of the results is one link away (docs/results.md)."""
from __future__ import annotations

import re

from evals.report_tables import _f, _spread, _table, peer_cells

PEERS = (("vllm", "vLLM's CPU build"), ("llamacpp", "llama.cpp"))  # engine prefix in the file, name shown
ENGINE_ALIASES = {"llama.cpp": "llamacpp", "llama_cpp": "llamacpp", "vllm-cpu": "vllm"}
# the ISA a box's flags imply, best first (where the file records no ISA of its own)
ISA_FROM_FLAGS = (("amx", ("amx_bf16", "amx_tile")), ("avx512_bf16", ("avx512_bf16",)), ("avx512", ("avx512f",)),
                  ("avx2", ("avx2",)))
SPEC_LABELS = {"eagle3": "eagle3 + n-gram (hybrid, the default)", "ngram": "ngram",
               "mtp": "mtp (shipped module)", "hybrid": "hybrid"}
SHORT_DTYPE = {"bfloat16": "bf16", "float32": "fp32"}


def _search(data, keys: tuple[str, ...]):
    """The first non-empty value under any of `keys`, breadth-first through nested dicts."""
    level = [data]
    while level:
        for d in level:
            for k in keys:
                if isinstance(d, dict) and d.get(k) not in (None, "", [], {}):
                    return d[k]
        level = [v for d in level if isinstance(d, dict) for v in d.values() if isinstance(v, dict)]
    return None


def box(data: dict) -> str:
    """'CPU model, ISA x, n cores' from the file: an `isa` field where the file has one (top level, machine,
    or the specpd probe's `cpu_isa`), else the best ISA its recorded CPU flags imply."""
    machine = data.get("machine") or {}
    model = machine.get("cpu_model") or machine.get("lscpu_model_name") or _search(data, ("cpu_model",)) or "?"
    isa = data.get("isa") or machine.get("isa") or _search(data, ("isa", "cpu_isa"))
    flags = machine.get("cpu_flags") or {}
    if not isa and flags:
        isa = next((name for name, need in ISA_FROM_FLAGS if all(flags.get(f) for f in need)), "none of avx2+")
    cores = machine.get("usable_cores") or machine.get("logical_cores")
    return ", ".join(x for x in (str(model), f"ISA {isa or 'not recorded'}", cores and f"{cores} cores") if x)


def _by_engine(cells: dict) -> dict[str, dict[str, dict]]:
    """engine -> config -> {dtype: cells}, engine names normalized (llama.cpp, llama_cpp -> llamacpp)."""
    out: dict[str, dict[str, dict]] = {}
    for name, c in cells.items():
        engine, config, dtype = (name.split("/") + ["?", "?"])[:3]
        engine = ENGINE_ALIASES.get(engine, engine)
        out.setdefault(engine, {}).setdefault(config, {})[dtype] = c
    return out


def _keys(*cell_sets: dict) -> tuple[list[str], list[int]]:
    """Workloads and concurrencies the cells hold, in the order a reader wants (c ascending)."""
    keys = {k for cs in cell_sets for k in cs}
    workloads = sorted({k.split("/")[0] for k in keys})
    conc = sorted({int(k.split("/c")[1]) for k in keys if re.fullmatch(r"\w+/c\d+", k)})
    return workloads, conc


def _cell(c: dict | None, c_level: int) -> str:
    """TPOT p50 at c1 (a user's latency), output tok/s above (the box's throughput); median (min–max, where the
    repetitions differ)."""
    field, p = ("tpot_p50_ms", 1) if c_level == 1 else ("output_tok_s", 0)
    if not c or c.get(field) is None:
        return "–"
    spread = c.get(field + "_spread")
    return _f(c[field], p) + (_spread(spread, p) if spread and _f(spread[0], p) != _f(spread[1], p) else "")


def specpd_weights(data: dict) -> str | None:
    """What specpd's default server ran, from its probe: 'bf16 over the GGUF's Q4_1 / Q8_0 blocks'."""
    runtime = (data.get("specpd_probe") or {}).get("runtime") or {}
    dtype = SHORT_DTYPE.get(runtime.get("dtype"), runtime.get("dtype"))
    formats = runtime.get("weight_formats") or {}
    if not dtype:
        return None
    if runtime.get("quantization") in (None, "none") or not formats:
        return f"{dtype}, dense weights"
    blocks = " / ".join(sorted(formats, key=lambda k: -formats[k]))
    return f"{dtype} activations over the GGUF's {blocks} blocks ({runtime['quantization']})"


def _default_dtype(data: dict) -> str:
    d = data.get("specpd_default_dtype") or "bfloat16"
    return SHORT_DTYPE.get(d, d)


def peer_table(data: dict, engine: str, shown: str) -> str:
    """specpd beside one peer, config by config: each of the peer's servers against specpd's server of the same
    config at the same dtype (a peer's q4_1 GGUF server against specpd's default dtype, what both serve by
    default); a config specpd lacks shows '–'."""
    name, by_engine = shown.split("'")[0].split()[0], _by_engine(peer_cells(data))
    mine, theirs = by_engine.get("specpd", {}), by_engine.get(engine, {})
    if not theirs:
        why = [s.get("reason") for s in data.get("skipped", []) if ENGINE_ALIASES.get(
            str(s.get("server", "")).split("/")[0], str(s.get("server", "")).split("/")[0]) == engine]
        return f"{shown}: not measured in this file" + (f" ({why[0]})" if why and why[0] else "") + "."
    workloads, conc = _keys(*(c for cfg in theirs.values() for c in cfg.values()))
    rows = []
    for config in sorted(theirs, key=lambda c: (c != "plain", c)):
        for dtype in sorted(theirs[config]):
            ours = dtype if dtype in mine.get(config, {}) else _default_dtype(data)
            label = f"{config} {dtype}" if ours == dtype else f"{config} (specpd {ours}, {name} {dtype})"
            for w in workloads:
                a, b = mine.get(config, {}).get(ours, {}), theirs[config][dtype]
                row = [label, w]
                for c in conc:
                    row += [_cell(a.get(f"{w}/c{c}"), c), _cell(b.get(f"{w}/c{c}"), c)]
                taus = [x.get(f"{w}/c1", {}).get("tau") for x in (a, b)]
                rows.append(row + [" / ".join(_f(t) for t in taus)])
    header = ["config", "workload"]
    for c in conc:
        what = "TPOT ms" if c == 1 else "tok/s"
        header += [f"specpd {what} c{c}", f"{name} {what} c{c}"]
    return _table(header + [f"τ c1 specpd / {name}"], rows)


def spec_table(data: dict) -> str:
    """Each of specpd's speculating servers against its plain server at the same dtype, from the file's
    `pairs` (rep by rep: the ratio's median and min–max): TPOT at c1 (plain's over the server's, > 1 faster),
    output tok/s above; τ and the share of rounds the adaptive policy spent at depth 0 from the cells."""
    cells, pairs = peer_cells(data), data.get("pairs") or {}
    names = [n for n in pairs if n.startswith("specpd/") and not n.startswith("specpd/plain/")]
    if not names:
        return "Speculation over plain: not measured in this file."
    workloads, conc = _keys(*(pairs[n] for n in names))
    rows = []
    for name in sorted(names):
        _, config, dtype = name.split("/")
        for w in workloads:
            row = [f"{SPEC_LABELS.get(config, config)} {dtype}", w]
            for c in conc:
                r = pairs[name].get(f"{w}/c{c}")
                field = "tpot_speedup" if c == 1 else "tok_s_ratio"
                row.append("–" if not r or r.get(field) is None else
                           _f(r[field], 2, "×") + _spread(r.get(field + "_spread")))
            c1 = cells.get(name, {}).get(f"{w}/c1", {})
            shares = [cells.get(name, {}).get(f"{w}/c{c}", {}).get("depth0_share") for c in conc]
            rows.append(row + [_f(c1.get("tau")), " / ".join("–" if s is None else f"{s:.0%}" for s in shares)])
    header = ["config", "workload", *(f"TPOT c{c} over plain" if c == 1 else f"tok/s c{c} over plain" for c in conc),
              "τ c1", "rounds at depth 0 " + " / ".join(f"c{c}" for c in conc)]
    return _table(header, rows)


def render(data: dict, command: str | None) -> str:
    """The README's Results block for one peers.json."""
    args = data.get("args") or {}
    paired = "each cell run on every server back to back (`python -m evals.peers --paired`)" if args.get("paired") else \
        "servers one at a time, in an order rotated rep by rep"
    reps = args.get("reps")
    reps = "one repetition" if reps == 1 else f"medians of {reps or '?'} repetitions (min–max)"
    weights = specpd_weights(data)
    head = (f"From `evals/results/peers.json`, model {data.get('model', 'default')}"
            f"{f'; specpd by default: {weights}' if weights else ''}; one OpenAI streaming client, greedy, "
            f"{args.get('max_tokens', '?')} tokens a request; {reps}, {paired}. TPOT at c1, output tok/s at "
            f"higher concurrency. Every other benchmark: [docs/results.md](docs/results.md); how each is run: "
            f"[docs/benchmarks.md](docs/benchmarks.md).")
    parts = [head]
    for engine, shown in PEERS:
        parts += [f"### specpd and {shown} ({box(data)})", peer_table(data, engine, shown)]
    parts += [f"### Speculation over specpd's plain decoding ({box(data)})", spec_table(data)]
    if command:
        parts.append(f"Rerun: `make peers && {command}`.")
    return "\n\n".join(parts)
