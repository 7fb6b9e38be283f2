"""Would an overlap scheduler pay on this box? Host work beside the forward against the same work after it.

Issue 33 asks for the anchors' overlap: scheduling, sampling / verify bookkeeping, detokenization and streaming
run beside the forward. On a GPU the forward leaves the host's cores idle; here the forward's OpenMP team holds
every core the server may use (torch threads = usable cores), so work moved beside it has no core of its own.
This measures that directly: the plain engine decodes one request at a time (greedy, 96 tokens) while a second
thread does W microseconds of pure-Python work per step (what an overlap scheduler would move off the critical
path) in one of three modes, rotated request by request:
  none     no extra work (the step alone);
  serial   the work right after each step, on the engine thread (what the engine does now);
  overlap  the work handed to the other thread at the end of each step, so it runs during the next step.
Per mode, the median step time (decode steps past the fifth). Overlap pays where `overlap` is near `none`; it
does not where it is near `serial`.

    python -m evals.engine_overlap            -> evals/results/engine_overlap.json
    python -m evals.engine_overlap --reps 2 --out /tmp/o.json   # smoke

(Below ~1 ms a step the difference is under what this box drifts between requests.)
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import threading
import time

EVALS_DIR = os.path.dirname(os.path.abspath(__file__))
from evals.harness.prompts import held_out_sharegpt_prompts
from evals.harness.results import log, machine_info, versions, write_json

from specpd.config import EngineConfig
from specpd.core import SamplingParams
from specpd.engine.llm_engine import LLMEngine
from specpd.machine import wait_for_collapse

MODES = ("none", "serial", "overlap")


def busy(seconds: float) -> None:
    """Pure-Python work holding the GIL for `seconds` (what the engine's bookkeeping is)."""
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        pass


class Helper:
    """A thread that does `seconds` of work each time it is poked."""

    def __init__(self):
        self.seconds, self.poke, self.stop = 0.0, threading.Event(), False
        self.thread = threading.Thread(target=self._loop, daemon=True)
        self.thread.start()

    def _loop(self) -> None:
        while not self.stop:
            if self.poke.wait(0.1):
                self.poke.clear()
                busy(self.seconds)


def decode(eng: LLMEngine, prompt: list[int], mode: str, work_s: float, helper: Helper, tokens: int) -> float:
    """Median decode step (ms) of one request in `mode`."""
    eng.add_request(f"{mode}-{time.monotonic_ns()}", prompt,
                    SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True))
    eng.step()  # the prefill
    helper.seconds = work_s
    steps = []
    while eng.has_unfinished_requests():
        t0 = time.perf_counter()
        eng.step()
        if mode == "serial":
            busy(work_s)
        elif mode == "overlap":
            helper.poke.set()
        steps.append(time.perf_counter() - t0)
    return 1000 * statistics.median(steps[5:])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--work-us", default="1000,3000", help="host work per step, microseconds (comma-separated)")
    ap.add_argument("--reps", type=int, default=8, help="requests per mode and work size")
    ap.add_argument("--tokens", type=int, default=96)
    ap.add_argument("--out", default=os.path.join(EVALS_DIR, "results", "engine_overlap.json"))
    args = ap.parse_args()
    from specpd.model.loader import load_checkpoint
    ckpt = load_checkpoint("default")
    eng = LLMEngine(EngineConfig(model="default"), checkpoint=ckpt)  # the served defaults (dtype, threads)
    wait_for_collapse()
    prompts = held_out_sharegpt_prompts(ckpt.tokenizer, args.reps)
    helper = Helper()
    decode(eng, prompts[0], "none", 0.0, helper, 16)  # warm-up
    cases = {}
    for work_us in (int(w) for w in args.work_us.split(",")):
        ms = {m: [] for m in MODES}
        for i, prompt in enumerate(prompts):
            for m in MODES[i % 3:] + MODES[:i % 3]:  # rotated request by request (the box drifts)
                ms[m].append(decode(eng, prompt, m, work_us / 1e6, helper, args.tokens))
        med = {m: statistics.median(v) for m, v in ms.items()}
        cases[f"{work_us}us"] = {
            "step_ms": {m: round(v, 3) for m, v in med.items()},
            "step_ms_per_request": {m: [round(x, 3) for x in v] for m, v in ms.items()},
            # what overlapping saved of what the serial work cost: 1 = all of it hidden, 0 = none
            "hidden_share": round((med["serial"] - med["overlap"]) / max(med["serial"] - med["none"], 1e-9), 3)}
        log(f"work {work_us} us", cases[f"{work_us}us"]["step_ms"], "hidden share", cases[f"{work_us}us"]["hidden_share"])
    helper.stop = True
    write_json(args.out, {"benchmark": "overlap", "description": __doc__.split("\n")[0],
                          "command": "python -m evals.engine_overlap", "machine": machine_info(),
                          "versions": versions(), "runtime": eng.runner.runtime_info(), "args": vars(args),
                          "cases": cases})
    return 0


if __name__ == "__main__":
    sys.exit(main())
