"""Cost of one target forward over T rows (decode, chain / tree verify) and of one draft step, on CPU.

Loads the default model (SmolLM2-135M, fp32), fills a paged KV pool with a ~500-token context on
scattered pages (batch 1 and batch 8), and times, interleaved, median of many reps:
  - a 1-row decode forward (+ LM head over its rows, argmax),
  - verify forwards over T = 2, 3, 5, 8, 16 rows per request (chain = causal) and a tree-masked T = 8,
    each with the LM head over all T rows (verify needs every row's logits),
  - one draft step (1 row per request, step >= 1: the draft's own hidden fed back) of each family:
    the shipped EAGLE-3 head, the shipped MTP head, a random-init EAGLE-1 head (full vocab), each
    including its LM head, softmax and top-k.
Every case includes AttentionMetadata.build + backend.plan, as the runners do each step.
Then a torch.profiler pass per case splits the time into categories (linears, attention incl. KV
write + page gather, metadata/plan, RoPE, norms, LM head (+softmax/topk), everything else = other
ops and Python glue), by wrapping the model's pieces in record_function scopes (this script only).

    .venv/bin/python evals/profile_forward.py --label before   # then, after a change, --label after
writes evals/results/profile_forward.json, keeping the other label's run. `--ab` also times every
case with the few-row CPU GEMM (specpd.kernels.cpu_gemm) switched off, interleaved in the same reps:
on a shared machine whose load changes between runs, that A/B is the fair comparison.
"""
from __future__ import annotations

import argparse
import contextlib
import os
import re
import statistics
import sys
import tempfile
import time
from collections import defaultdict

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
from torch import nn  # noqa: E402

import specpd.model.llama as llama  # noqa: E402
from evals.common import REPO_ROOT, log, machine_info, versions, write_json  # noqa: E402
from specpd.attention.metadata import AttentionMetadata  # noqa: E402
from specpd.config import CacheConfig, EngineConfig  # noqa: E402
from specpd.draft.loader import load_draft_model, random_draft_checkpoint  # noqa: E402
from specpd.kv.pool import KVPool  # noqa: E402
from specpd.model.loader import load_checkpoint  # noqa: E402
from specpd.model.runner import ModelRunner  # noqa: E402

OUT = os.path.join(REPO_ROOT, "evals", "results", "profile_forward.json")
PAGE_SIZE = 16
VERIFY_ROWS = (2, 3, 5, 8, 16)
TREE_PARENTS = [-1, 0, 0, 0, 1, 1, 2, 4]  # an 8-node top-3 style tree (node 0 = root)
CATEGORIES = ("linears", "attention", "metadata/plan", "rope", "norms", "lm head")


def tree_mask(parents: list[int]) -> torch.Tensor:
    """Ancestor-or-self relation [n, n] bool."""
    n = len(parents)
    mask = torch.zeros(n, n, dtype=torch.bool)
    for i in range(n):
        j = i
        while j >= 0:
            mask[i, j] = True
            j = parents[j]
    return mask


class Setup:
    def __init__(self, ctx: int, max_batch: int, seed: int = 0):
        self.ctx = ctx
        pages_per_req = -(-(ctx + 32) // PAGE_SIZE)
        num_pages = max_batch * pages_per_req + 4
        ckpt = load_checkpoint("default")
        cfg = EngineConfig(model="default", dtype="float32", num_threads=1,
                           cache=CacheConfig(page_size=PAGE_SIZE, num_pages=num_pages))
        # one extra KV layer in every page: the drafts' layer, as the engine shares target pages (DESIGN.md §3)
        self.runner = ModelRunner(cfg, ckpt, max_model_len=2048, kv_extra_layers=1)
        self.model, self.backend, pool = self.runner.model, self.runner.backend, self.runner.kv_pool
        gen = torch.Generator().manual_seed(seed)
        pool.buffer.copy_(torch.randn(pool.buffer.shape, generator=gen) * 0.5)
        perm = torch.randperm(num_pages, generator=gen).tolist()  # scattered pages
        self.pages = [perm[b * pages_per_req:(b + 1) * pages_per_req] for b in range(max_batch)]
        self.vocab = self.runner.model_config.vocab_size
        self.gen = gen
        mc = self.runner.model_config
        self.drafts = {}
        draft_pool = KVPool.layers_of(pool, mc.num_layers, 1)
        backend_cls = type(self.backend)
        for family in ("eagle3", "mtp"):
            draft = load_draft_model("default", family, self.model, mc, torch.float32)
            self.drafts[family] = (draft, backend_cls(draft_pool, draft.config.num_heads, draft.config.head_dim))
        with tempfile.TemporaryDirectory() as d:
            random_draft_checkpoint(d, "eagle", mc, seed=0)
            draft = load_draft_model(d, "eagle", self.model, mc, torch.float32)
            self.drafts["eagle1_random_full_vocab"] = (draft, backend_cls(draft_pool, draft.config.num_heads,
                                                                          draft.config.head_dim))

    def ids(self, n: int) -> torch.Tensor:
        return torch.randint(0, self.vocab, (n,), generator=self.gen)

    @torch.inference_mode()
    def target_case(self, batch: int, rows: int, tree: bool):
        """A closure running one target forward over `rows` rows per request (+ LM head on every row)."""
        ctx = self.ctx
        ids = self.ids(batch * rows)
        positions = torch.tensor([ctx + j for _ in range(batch) for j in range(rows)])
        masks = [tree_mask(TREE_PARENTS) for _ in range(batch)] if tree else None
        pages = self.pages[:batch]

        def run():
            meta = AttentionMetadata.build(q_lens=[rows] * batch, kv_lens=[ctx + rows] * batch, page_lists=pages,
                                           page_size=PAGE_SIZE, tree_masks=masks)
            self.backend.plan(meta)
            hidden, _ = self.model(ids, positions, self.backend, meta)
            return self.model.compute_logits(hidden).argmax(dim=-1)
        return run

    @torch.inference_mode()
    def draft_case(self, family: str, batch: int):
        """One chain draft step (step 1: 1 row per request, fed its own previous hidden) + head/softmax/top-k."""
        draft, backend = self.drafts[family]
        ctx = self.ctx
        ids = self.ids(batch)
        hidden = torch.randn(batch, draft.config.hidden_size, generator=self.gen)
        positions = torch.full((batch,), ctx)
        pages = self.pages[:batch]

        def run():
            meta = AttentionMetadata.build(q_lens=[1] * batch, kv_lens=[ctx + 1] * batch, page_lists=pages,
                                           page_size=PAGE_SIZE)
            backend.plan(meta)
            out = draft(ids, hidden, positions, backend, meta, step=1)
            probs = torch.softmax(draft.compute_logits(out, step=1), dim=-1)
            vals, top = probs.topk(1, dim=-1)
            return draft.draft_to_target(top), vals
        return run


def cases(setup: Setup, batches: list[int]) -> dict[str, callable]:
    out = {}
    for b in batches:
        out[f"b{b}/decode"] = setup.target_case(b, 1, False)
        for t in VERIFY_ROWS:
            out[f"b{b}/verify_T{t}"] = setup.target_case(b, t, False)
        out[f"b{b}/verify_T8_tree"] = setup.target_case(b, 8, True)
        for family in setup.drafts:
            out[f"b{b}/draft_{family}"] = setup.draft_case(family, b)
    return out


def kernel_off(fn):
    """fn with specpd.kernels.cpu_gemm's few-row kernel disabled (torch's matmul everywhere)."""
    from specpd.kernels import cpu_gemm

    def run():
        orig = cpu_gemm.use_packed
        cpu_gemm.use_packed = lambda x: False
        try:
            return fn()
        finally:
            cpu_gemm.use_packed = orig
    return run


def wall_clock(runs: dict[str, callable], reps: int) -> dict[str, float]:
    """Median ms per case; cases interleaved within each rep so load drift hits all alike."""
    times = defaultdict(list)
    with torch.inference_mode():
        for fn in runs.values():  # warm-up
            fn()
        for _ in range(reps):
            for name, fn in runs.items():
                t0 = time.perf_counter()
                fn()
                times[name].append(time.perf_counter() - t0)
    return {name: round(1e3 * statistics.median(v), 3) for name, v in times.items()}


@contextlib.contextmanager
def scoped(setup: Setup):
    """Wrap the model's pieces in record_function scopes named 'cat::<category>' (undone on exit).
    Only the outermost piece opens a scope (the LM head's matmul counts as LM head, not linears)."""
    from torch.profiler import record_function
    patches = []
    depth = [0]

    def wrap(owner, attr, category):
        orig = getattr(owner, attr)

        def timed(*args, **kwargs):
            if depth[0]:
                return orig(*args, **kwargs)
            depth[0] += 1
            try:
                with record_function(f"cat::{category}"):
                    return orig(*args, **kwargs)
            finally:
                depth[0] -= 1
        setattr(owner, attr, timed)
        patches.append((owner, attr, orig))

    wrap(nn.Linear, "forward", "linears")
    wrap(llama.MatmulLinear, "forward", "linears")
    if hasattr(llama, "apply_linear"):  # the draft layers' nn.Linear since the cpu_gemm change
        import specpd.kernels.cpu_gemm as cpu_gemm
        wrap(cpu_gemm, "linear", "linears")
    for cls in {type(setup.backend)}:
        wrap(cls, "forward", "attention")
        wrap(cls, "plan", "metadata/plan")
    wrap(AttentionMetadata, "build", "metadata/plan")
    wrap(llama, "apply_rope", "rope")
    wrap(llama.Rotary, "table", "rope")
    wrap(llama.RMSNorm, "forward", "norms")
    wrap(llama.CausalLM, "compute_logits", "lm head")
    for draft, _ in setup.drafts.values():
        wrap(type(draft), "compute_logits", "lm head")
    wrap(torch, "softmax", "lm head")
    try:
        yield
    finally:
        for owner, attr, orig in reversed(patches):
            setattr(owner, attr, orig)


def breakdown(setup: Setup, runs: dict[str, callable], reps: int) -> dict[str, dict]:
    """Per case: profiler ms per call of each category (inclusive), 'other' = the rest of the step,
    and the top aten ops by self time."""
    from torch.profiler import ProfilerActivity, profile, record_function
    out = {}
    with torch.inference_mode(), scoped(setup):
        for name, fn in runs.items():
            fn()
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                for _ in range(reps):
                    with record_function("step"):
                        fn()
            cat = defaultdict(float)
            ops = defaultdict(float)
            step = 0.0
            for ev in prof.events():
                if ev.name == "step":
                    step += ev.cpu_time_total
                elif ev.name.startswith("cat::"):
                    cat[ev.name[5:]] += ev.cpu_time_total
                elif ev.name.startswith("aten::"):
                    ops[ev.name] += ev.self_cpu_time_total
            parts = {c: round(cat[c] / reps / 1e3, 3) for c in CATEGORIES}
            parts["other ops + python glue"] = round((step - sum(cat.values())) / reps / 1e3, 3)
            top = sorted(ops.items(), key=lambda kv: -kv[1])[:8]
            out[name] = {"profiled_step_ms": round(step / reps / 1e3, 3), "ms": parts,
                         "top_aten_self_ms": {k: round(v / reps / 1e3, 3) for k, v in top}}
    return out


def ratios(wall: dict[str, float], batches: list[int], drafts) -> dict[str, float]:
    out = {}
    for b in batches:
        base = wall.get(f"b{b}/decode")
        for name in [f"verify_T{t}" for t in VERIFY_ROWS] + ["verify_T8_tree"] + [f"draft_{f}" for f in drafts]:
            if base is not None and f"b{b}/{name}" in wall:
                out[f"b{b}/{name}_over_decode"] = round(wall[f"b{b}/{name}"] / base, 3)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--label", default="after", help="key in the JSON (before / after)")
    ap.add_argument("--ctx", type=int, default=500)
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--profile-reps", type=int, default=3)
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--no-profile", action="store_true")
    ap.add_argument("--only", default="", help="regex: run only the matching cases (a quick look, not a record)")
    ap.add_argument("--ab", action="store_true",
                    help="also time every case with the cpu_gemm kernel off, interleaved in the same reps "
                         "(an A/B under the same machine load)")
    ap.add_argument("--out", default=OUT)
    args = ap.parse_args()
    torch.set_num_threads(1)
    ver = versions()
    batches = [int(b) for b in args.batches.split(",")]
    t0 = time.perf_counter()
    setup = Setup(args.ctx, max(batches))
    runs = cases(setup, batches)
    if args.only:
        runs = {k: v for k, v in runs.items() if re.search(args.only, k)}
    timed = dict(runs)
    if args.ab:
        timed.update({f"{k} [cpu_gemm off]": kernel_off(fn) for k, fn in runs.items()})
    wall = wall_clock(timed, args.reps)
    result = {"versions": ver, "machine": machine_info(), "loadavg_before": list(os.getloadavg()),
              "ctx_tokens": args.ctx, "page_size": PAGE_SIZE, "reps": args.reps,
              "note": "ms per call, median over interleaved reps; each call = metadata build + plan + forward "
                      "+ LM head (all rows) + argmax (target) or + softmax + top-1 (draft step, 1 row/request); "
                      "tree = 8-node tree mask; breakdown = torch.profiler CPU time per category (inclusive, "
                      "profiler overhead included)",
              "wall_ms": {k: v for k, v in wall.items() if "[" not in k},
              "ratios": ratios(wall, batches, setup.drafts)}
    if args.ab:
        off = {k.split(" [")[0]: v for k, v in wall.items() if "[cpu_gemm off]" in k}
        result["ab_cpu_gemm_off"] = {"note": "same process, same reps, interleaved: the kernel off "
                                             "(MKL / F.linear for every row count)",
                                     "wall_ms": off, "ratios": ratios(off, batches, setup.drafts)}
    if not args.no_profile:
        result["breakdown"] = breakdown(setup, runs, args.profile_reps)
    result["loadavg_after"] = list(os.getloadavg())
    result["wall_s"] = round(time.perf_counter() - t0, 1)
    report = {}
    if os.path.exists(args.out):
        import json
        with open(args.out, encoding="utf-8") as f:
            report = json.load(f)
    report[args.label] = result
    write_json(args.out, report)
    for name, ms in wall.items():
        log(f"{name:32s} {ms:9.2f} ms")
    for name, r in result["ratios"].items():
        log(f"{name:40s} {r:6.3f}")
    log(f"wrote {args.out} [{args.label}]")


if __name__ == "__main__":
    main()
