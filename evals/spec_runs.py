"""The replay bench's runner, shared by evals/spec.py and evals/spec_trained.py: one engine per config,
every config run rep by rep in a rotating order, the per-config summaries and the ratios to the base config.

CONFIGS are spec.py's replay configs (SPEC_STEPS: their speculative steps).
"""
from __future__ import annotations

import os
import time

from evals.harness.results import log, median

from specpd.config import CacheConfig, EngineConfig, SpecConfig
from specpd.core import SamplingParams
from specpd.engine.llm_engine import LLMEngine

SPEC_STEPS = 4
CONFIGS = {  # name -> (SpecConfig, replay corrupt depths)
    "base": (SpecConfig(), ()),
    "chain": (SpecConfig("replay", spec_num_steps=SPEC_STEPS), ()),
    "tree": (SpecConfig("replay", spec_num_steps=SPEC_STEPS, spec_topk=3, spec_num_draft_tokens=8), ()),
    "partial": (SpecConfig("replay", spec_num_steps=SPEC_STEPS), (3,)),
    "chain_s2": (SpecConfig("replay", spec_num_steps=2), ()),
}


class Bench:
    """One engine; `run` times a batch of greedy requests to completion."""

    def __init__(self, name: str, ckpt, spec: SpecConfig, corrupt: tuple[int, ...], num_pages: int, dtype: str):
        self.name = name
        self.engine = LLMEngine(EngineConfig(model="default", dtype=dtype, spec=spec,
                                             cache=CacheConfig(page_size=16, num_pages=num_pages)), checkpoint=ckpt)
        if self.engine.spec_runner is not None and hasattr(self.engine.spec_runner.proposer, "references"):
            self.engine.spec_runner.proposer.corrupt_depths = set(corrupt)
            self.engine.spec_runner.proposer.right_rank = 0
        self._runs = 0

    def run(self, prompts: list[list[int]], output_len: int, references: list[list[int]] | None = None) -> dict:
        eng = self.engine
        params = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
        self._runs += 1
        ids = [f"{self.name}-{self._runs}-{i}" for i in range(len(prompts))]
        proposer = eng.spec_runner.proposer if eng.spec_runner else None
        if references is not None and hasattr(proposer, "references"):
            proposer.references.update(zip(ids, references))
        final, started, t_first = {}, set(), None
        load = os.getloadavg()[0]
        c0, t0 = time.process_time(), time.perf_counter()
        for rid, prompt in zip(ids, prompts):
            eng.add_request(rid, prompt, params)
        while eng.has_unfinished_requests():
            outs = eng.step()
            started.update(o.request_id for o in outs if o.new_token_ids)
            if t_first is None and len(started) == len(ids):
                t_first, c_first = time.perf_counter() - t0, time.process_time() - c0
            final.update((o.request_id, o) for o in outs if o.finished)
        t_total, cpu = time.perf_counter() - t0, time.process_time() - c0
        for rid in ids:
            getattr(proposer, "references", {}).pop(rid, None)
        outs = [final[r] for r in ids]
        n_out = sum(len(o.token_ids) for o in outs)
        verifies = sum(o.spec_verify_count for o in outs)
        row = {"loadavg_1m": load, "cpu_util": cpu / t_total, "t_total_s": t_total, "ttft_s": t_first,
               "tokens_per_s": n_out / t_total,
               "decode_tokens_per_s": len(ids) * (output_len - 1) / (t_total - t_first),
               "decode_tokens_per_cpu_s": len(ids) * (output_len - 1) / (cpu - c_first),
               "outputs": [o.token_ids for o in outs]}
        if verifies:
            row["accept_length"] = sum(o.spec_committed_tokens for o in outs) / verifies  # tau, bonus included
            row["accepted_per_verify"] = sum(o.spec_accepted_tokens for o in outs) / verifies
            row["verify_count"] = verifies
        return row


def interleaved_reps(benches: dict[str, Bench], prompts: list[list[int]], output_len: int,
                     batch_sizes: list[int], reps: dict[int, int]):
    """Every config at every batch size, rep by rep in a rotating order (rep 0 starts with the first
    config, whose outputs become the references: replay drafters replay them, every run must equal
    them). Returns ({(config, batch): [row per rep]}, {batch: reference outputs})."""
    names = list(benches)
    raw: dict[tuple[str, int], list[dict]] = {(n, b): [] for n in names for b in batch_sizes}
    references: dict[int, list[list[int]]] = {}
    for rep in range(max(reps.values())):
        order = names[rep % len(names):] + names[:rep % len(names)]
        for b in (b for b in batch_sizes if rep < reps[b]):
            for name in order:
                row = benches[name].run(prompts[:b], output_len, references.get(b))
                references.setdefault(b, row["outputs"])
                row["lossless"] = row["outputs"] == references[b]
                raw[name, b].append(row)
                log(f"rep {rep} b{b} {name:>22}: {row['tokens_per_s']:6.1f} tok/s  decode "
                    f"{row['decode_tokens_per_s']:6.1f} (/cpu-s {row['decode_tokens_per_cpu_s']:6.1f})  "
                    f"tau {row.get('accept_length', 1.0):.2f}  "
                    f"lossless {row['lossless']}  load {row['loadavg_1m']:.2f}  cpu {row['cpu_util']:.2f}")
    return raw, references


def summarize(raw: dict[tuple[str, int], list[dict]]) -> list[dict]:
    results = []
    for (name, b), rows in raw.items():
        entry = {"config": name, "batch_size": b, "reps": len(rows)}
        for field in ("tokens_per_s", "decode_tokens_per_s", "decode_tokens_per_cpu_s", "ttft_s", "accept_length",
                      "accepted_per_verify"):
            if field in rows[0]:
                entry[field] = median([r[field] for r in rows])
                entry[field + "_all"] = [round(r[field], 3) for r in rows]
        entry["lossless_all_reps"] = all(r["lossless"] for r in rows)
        entry["loadavg_1m_all"] = [round(r["loadavg_1m"], 2) for r in rows]
        entry["cpu_util_all"] = [round(r["cpu_util"], 3) for r in rows]
        results.append(entry)
    return results


def compare(raw: dict[tuple[str, int], list[dict]], names: list[str], batch_sizes: list[int]) -> dict:
    ratios = {}
    for b in batch_sizes:
        for name in names[1:]:
            for field, tag in (("decode_tokens_per_s", "decode"), ("tokens_per_s", "e2e"),
                               ("decode_tokens_per_cpu_s", "decode_cpu")):
                spec, base = raw[name, b], raw["base", b]
                ratios[f"{name}_over_base_b{b}_{tag}"] = (median([r[field] for r in spec])
                                                          / median([r[field] for r in base]))
                ratios[f"{name}_over_base_b{b}_{tag}_paired"] = median([s[field] / r[field]
                                                                        for s, r in zip(spec, base)])
    return ratios
