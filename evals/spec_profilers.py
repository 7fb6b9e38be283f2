"""Where a speculative round's time goes, for evals/spec.py: wall-clock and CPU timers around the engine's
parts, a torch.profiler op table, a cProfile top list, the drafting cost of a random EAGLE-1 draft, and a
matmul microbenchmark of the target's linear shapes.
"""
from __future__ import annotations

import cProfile
import contextlib
import os
import pstats
import tempfile
import time
import types
from collections import defaultdict

import torch
from evals.harness.results import median
from evals.spec_runs import SPEC_STEPS, Bench

import specpd.spec.commit as spec_verify_module
import specpd.kernels.kv_compact as kv_compact_module
from specpd.config import ModelConfig, SpecConfig
from specpd.core import SamplingParams
from specpd.spec.draft.loader import random_draft_checkpoint
from specpd.engine.llm_engine import LLMEngine

EVALS_DIR = os.path.dirname(os.path.abspath(__file__))


class Timers:
    """Wall-clock accumulators wrapped around chosen callables (instance methods or module functions)."""

    def __init__(self):
        self.total: dict[str, float] = defaultdict(float)  # wall seconds
        self.cpu: dict[str, float] = defaultdict(float)  # process CPU seconds
        self.calls: dict[str, int] = defaultdict(int)
        self.enabled = False
        self._patches = []

    def wrap(self, owner, attr: str, name: str) -> None:
        fn = getattr(owner, attr)

        def timed(*args, **kwargs):
            if not self.enabled:
                return fn(*args, **kwargs)
            t0, c0 = time.perf_counter(), time.process_time()
            try:
                return fn(*args, **kwargs)
            finally:
                self.total[name] += time.perf_counter() - t0
                self.cpu[name] += time.process_time() - c0
                self.calls[name] += 1

        setattr(owner, attr, timed)
        self._patches.append((owner, attr, fn))

    def restore(self) -> None:
        for owner, attr, fn in reversed(self._patches):
            if isinstance(owner, types.ModuleType):
                setattr(owner, attr, fn)
            else:
                delattr(owner, attr)  # the instance attribute shadowed the class's method
        self._patches.clear()


def instrument(engine: LLMEngine) -> Timers:
    tm = Timers()
    tm.wrap(engine, "step", "step")
    tm.wrap(engine.scheduler, "schedule", "scheduler.schedule")
    tm.wrap(engine, "_postprocess", "postprocess (commit, stop checks, detokenize)")
    tm.wrap(engine.runner.model, "forward", "target forward")
    tm.wrap(engine.runner.model, "compute_logits", "target lm head")
    if engine.spec_runner is None:
        tm.wrap(engine.runner, "execute", "runner.execute")
        return tm
    sr = engine.spec_runner
    tm.wrap(sr, "execute", "runner.execute")
    tm.wrap(sr.proposer, "propose", "proposer.propose")
    tm.wrap(sr.proposer, "extend", "proposer.extend")
    tm.wrap(spec_verify_module, "verify_greedy", "verify_greedy")  # the names the engine calls them by
    tm.wrap(kv_compact_module, "compact_kv_ref", "kv compaction")  # the CPU path of ModelRunner.compact_kv
    draft = getattr(sr.proposer, "draft", None)
    if draft is not None:
        tm.wrap(draft, "forward", "draft forward (fc + 1 layer)")
        tm.wrap(draft, "compute_logits", "draft lm head")
        tm.wrap(sr.proposer, "_topk", "draft lm head + softmax + topk")
    return tm


def profile_rounds(bench: Bench, prompt: list[int], rounds: int, tau: float, reference: list[int] | None) -> dict:
    """Timers over `rounds` decode steps at batch 1 (the prefill step is excluded)."""
    eng = bench.engine
    output_len = 1 + round(rounds * tau)
    tm = instrument(eng)
    rid = f"{bench.name}-profile"
    proposer = eng.spec_runner.proposer if eng.spec_runner else None
    if reference is not None and hasattr(proposer, "references"):
        proposer.references[rid] = reference
    eng.add_request(rid, prompt, SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True))
    eng.step()  # prefill
    tm.enabled = True
    steps, final = 0, None
    while eng.has_unfinished_requests():
        steps += 1
        final = next((o for o in eng.step() if o.finished), final)
    tm.restore()
    getattr(proposer, "references", {}).pop(rid, None)
    wall, cpu = parts(tm.total, steps), parts(tm.cpu, steps)
    step, cpu_step = wall.pop("step"), cpu.pop("step")
    out = {"steps": steps, "tokens": len(final.token_ids) - 1 if final else None,
           "accept_length": final.spec_accept_length if final else None,
           "ms_per_step": step, "cpu_ms_per_step": cpu_step, "cpu_util": cpu_step / step,
           "ms_per_step_parts": {k: round(v, 3) for k, v in wall.items()},
           "cpu_ms_per_step_parts": {k: round(v, 3) for k, v in cpu.items()},
           "cpu_share_of_step": {k: round(v / cpu_step, 3) for k, v in cpu.items() if k != "runner.execute"},
           "calls": dict(tm.calls)}
    if final is not None and final.spec_verify_count:
        out["decode_tokens_per_s_in_profile"] = 1e3 * (len(final.token_ids) - 1) / (step * steps)
    return out


def parts(seconds: dict[str, float], steps: int) -> dict[str, float]:
    """Timer totals -> ms per step, with the un-timed remainders of runner.execute and of step."""
    per = {k: 1e3 * v / steps for k, v in seconds.items()}
    nested = ("proposer.propose", "proposer.extend", "target forward", "target lm head", "verify_greedy",
              "kv compaction")
    per["runner python (inputs, metadata, masks, sampling glue)"] = (per["runner.execute"]
                                                                    - sum(per.get(k, 0.0) for k in nested))
    per["engine other"] = (per["step"] - per["runner.execute"] - per["scheduler.schedule"]
                           - per["postprocess (commit, stop checks, detokenize)"])
    return per


@contextlib.contextmanager
def replayed_request(bench: Bench, tag: str, prompt: list[int], reference: list[int], rounds: int):
    """One greedy request replaying `reference` for `rounds` full-acceptance rounds, its first step taken; the
    block steps it to the end (what op_table and cprofile_top measure); then the reference is dropped."""
    eng = bench.engine
    rid = f"{bench.name}-{tag}"
    eng.spec_runner.proposer.references[rid] = reference
    eng.add_request(rid, prompt, SamplingParams(max_tokens=1 + rounds * (SPEC_STEPS + 1), temperature=0.0,
                                                ignore_eos=True))
    eng.step()
    yield eng
    eng.spec_runner.proposer.references.pop(rid, None)


def op_table(bench: Bench, prompt: list[int], reference: list[int], rounds: int, top: int = 12) -> list[dict]:
    """torch.profiler self-CPU time per op over `rounds` spec rounds (prefill included, small)."""
    from torch.profiler import ProfilerActivity, profile
    with replayed_request(bench, "ops", prompt, reference, rounds) as eng:
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            while eng.has_unfinished_requests():
                eng.step()
    rows = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)
    total = sum(e.self_cpu_time_total for e in rows)
    return [{"op": e.key, "calls_per_round": round(e.count / rounds, 1),
             "self_ms_per_round": round(e.self_cpu_time_total / 1e3 / rounds, 3),
             "share": round(e.self_cpu_time_total / total, 3)} for e in rows[:top]]


def cprofile_top(bench: Bench, prompt: list[int], reference: list[int], rounds: int, top: int = 15) -> list[dict]:
    with replayed_request(bench, "cprofile", prompt, reference, rounds) as eng:
        prof = cProfile.Profile()
        prof.enable()
        while eng.has_unfinished_requests():
            eng.step()
        prof.disable()
    stats = pstats.Stats(prof)
    rows = sorted(stats.stats.items(), key=lambda kv: kv[1][2], reverse=True)[:top]  # by tottime
    return [{"function": f"{os.path.relpath(f, os.path.dirname(EVALS_DIR)) if f.startswith('/') else f}:{line}({fn})",
             "calls_per_round": round(cc / rounds, 1), "tottime_ms_per_round": round(1e3 * tt / rounds, 3),
             "cumtime_ms_per_round": round(1e3 * ct / rounds, 3)}
            for (f, line, fn), (cc, nc, tt, ct, _) in rows]


def eagle_costs(ckpt, prompt: list[int], reference: list[int], num_pages: int, args) -> dict:
    """Per-round cost of EAGLE-1 drafting with a random draft (acceptance ~0), chain S=4, batch 1."""
    target_cfg = ModelConfig.from_hf(ckpt.hf_config)
    out = {"note": "random-init EAGLE-1 draft (fc + 1 Llama layer, target embedding), chain S=4: "
                   "acceptance ~0, this measures the drafting cost per round only"}
    for label, vocab in (("full_vocab", None), ("draft_vocab_8192", 8192)):
        with tempfile.TemporaryDirectory() as d:
            random_draft_checkpoint(d, "eagle", target_cfg, seed=0, draft_vocab_size=vocab)
            spec = SpecConfig("eagle", draft_model=d, spec_num_steps=SPEC_STEPS, spec_ngram=False)
            bench = Bench(f"eagle-{label}", ckpt, spec, (), num_pages, args.dtype)
        bench.run([prompt[:32]], 6)  # warmup
        prof = profile_rounds(bench, prompt, args.profile_rounds, 1.0, None)
        draft = bench.engine.spec_runner.proposer.draft
        p = prof["cpu_ms_per_step_parts"]
        drafting = p["proposer.propose"] + p["proposer.extend"]
        head = p["draft lm head + softmax + topk"]
        out[label] = {
            "draft_vocab_size": draft.draft_vocab_size, "cpu_ms_per_round": prof["cpu_ms_per_step"],
            "wall_ms_per_round": prof["ms_per_step"],
            "drafting_cpu_ms_per_round": drafting,
            "draft_forward_cpu_ms_per_round": p["draft forward (fc + 1 layer)"],
            "draft_lm_head_cpu_ms_per_round": p["draft lm head"],
            "draft_head_softmax_topk_cpu_ms_per_round": head,
            "draft_head_share_of_drafting": head / drafting,
            "draft_head_share_of_round": head / prof["cpu_ms_per_step"],
            "drafting_share_of_round": drafting / prof["cpu_ms_per_step"],
            "target_forward_cpu_ms_per_round": p["target forward"],
            "accept_length": prof["accept_length"], "profile": prof}
        check = bench.run([prompt], 1 + args.profile_rounds)
        out[label]["lossless_vs_base"] = check["outputs"][0] == reference[:1 + args.profile_rounds]
        del bench
    full, small = out["full_vocab"], out["draft_vocab_8192"]
    out["drafting_cpu_ms_saved_by_8192_vocab"] = full["drafting_cpu_ms_per_round"] - small["drafting_cpu_ms_per_round"]
    return out


def linear_microbench(cfg: ModelConfig, reps: int, rows: tuple[int, ...] = (1, 3, 5, 8, 40)) -> dict:
    """fp32 matmul time vs rows M for the target's linear shapes: F.linear with the weight as stored
    ([out, in], what the model runs) vs x @ W_t with the weight pre-transposed ([in, out] contiguous).
    Variants and M are interleaved; medians over `reps`. `per_forward_*`: the layer shapes times
    num_layers, plus the LM head, i.e. the matmul part of one target forward over M rows."""
    shapes = {"qkv_proj": (cfg.q_size + 2 * cfg.kv_size, cfg.hidden_size), "o_proj": (cfg.hidden_size, cfg.q_size),
              "gate_up_proj": (2 * cfg.intermediate_size, cfg.hidden_size),
              "down_proj": (cfg.hidden_size, cfg.intermediate_size), "lm_head": (cfg.vocab_size, cfg.hidden_size)}
    gen = torch.Generator().manual_seed(0)
    times: dict[tuple[str, str, int], list[float]] = defaultdict(list)
    with torch.inference_mode():
        weights = {n: torch.randn(o, i, generator=gen) for n, (o, i) in shapes.items()}
        transposed = {n: w.t().contiguous() for n, w in weights.items()}
        inputs = {(n, m): torch.randn(m, shapes[n][1], generator=gen) for n in shapes for m in rows}
        variants = {"linear_out_in": lambda n, x: torch.nn.functional.linear(x, weights[n]),
                    "matmul_in_out": lambda n, x: x @ transposed[n]}
        for _ in range(reps + 1):  # the first round warms up
            for n in shapes:
                for m in rows:
                    for v, fn in variants.items():
                        t0 = time.perf_counter()
                        fn(n, inputs[n, m])
                        times[n, v, m].append(time.perf_counter() - t0)
    ms = {k: 1e3 * median(v[1:]) for k, v in times.items()}
    out: dict = {"rows": list(rows), "reps": reps,
                 "ms": {f"{n}/{v}": [round(ms[n, v, m], 4) for m in rows] for n in shapes for v in variants}}
    for v in variants:
        out[f"per_forward_ms/{v}"] = [round(sum(ms[n, v, m] for n in shapes if n != "lm_head") * cfg.num_layers
                                            + ms["lm_head", v, m], 2) for m in rows]
    return out
