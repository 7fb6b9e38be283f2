"""The engine on a CUDA GPU against the targets of issue 67: decode steps with and without CUDA graphs, a verify
forward, speculation over plain decoding, PD against unified, graphs against eager.

Run where a GPU is, by `bash evals/gpu_check.sh` (after the GPU tests) → evals/results/gpu.json. Cells:
  - decode: the engine's plain decode step (a round of the step loop, sampling included) at batch 1 and 32
    (256-token prompts, 64 new tokens), CUDA graphs on and off; their greedy tokens compared (graphs == eager);
  - verify: one target forward over a verify batch (batch 1 and 32, the hybrid default tree's rows each, tree
    masks), graphs on and off, in process;
  - eagle3_chat_c1: EAGLE-3 with the shipped head and the defaults (hybrid, adaptive) against plain decoding, one
    request at a time over held-out chat prompts: TPOT per request, median, and τ; outputs equal plain;
  - ngram_grounded_c1: n-gram drafting with its defaults on the grounded rewrite prompts, the same way;
  - pd: a prefill and a decode worker (KV in GPU memory, Mooncake) against the unified engine's greedy tokens.
The speculation cells need the default model's real weights and the prompts, which cannot ride along with the
repository (a device call carries 64 MiB): `evals/gpu_stage.py` packs them here and gpu_check.sh reassembles them
there (--model, --prompts). Without them the target is SmolLM2-135M's shape with random weights (the same work
per step) and those cells say why they were not measured; PD needs pyzmq and Mooncake's CUDA build staged the same
way. `--smoke`: tiny shapes on the CPU through the graphs' padded path without capture (the same code end to end).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
EVALS_DIR = os.path.dirname(os.path.abspath(__file__))

import torch

from evals.harness.results import REPO_ROOT, command_line, machine_info, versions
from specpd.config import CacheConfig, EngineConfig, SchedulerConfig, SpecConfig
from specpd.core import SamplingParams
from specpd.engine.llm_engine import LLMEngine

SMOLLM2_135M = dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                    num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=8192,
                    rope_theta=100000.0, rms_norm_eps=1e-5, tie_word_embeddings=True, bos_token_id=1, eos_token_id=2)
TINY = dict(SMOLLM2_135M, num_hidden_layers=8, vocab_size=2048, max_position_embeddings=1024)
TARGETS = {"decode_b1_graphs_ms": ("<=", 1.5), "decode_b32_graphs_ms": ("<=", 2.0),
           "eagle3_chat_c1_tpot_over_plain": (">=", 1.5), "ngram_grounded_c1_tpot_over_plain": (">=", 2.5),
           "pd_equals_unified": ("==", True), "graphs_equal_eager": ("==", True)}


def save_random_target(path: str, config: dict, seed: int = 0) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(seed)
    LlamaForCausalLM(LlamaConfig(**config)).save_pretrained(path, safe_serialization=True)


def random_prompts(batch: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (length,), generator=gen).tolist() for _ in range(batch)]


def make_engine(args, graphs: bool, spec: SpecConfig | None = None, with_draft: bool = True) -> LLMEngine:
    return LLMEngine(EngineConfig(model=args.model, device=args.device, dtype=args.dtype,
                                  attention_backend=args.backend, cuda_graphs=graphs,
                                  cuda_graph_eager=graphs and args.device == "cpu", max_model_len=args.max_model_len,
                                  cache=CacheConfig(page_size=16, num_pages=args.num_pages),
                                  scheduler=SchedulerConfig(max_running_requests=64), spec=spec or SpecConfig()),
                     with_draft=with_draft)


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def decode_run(args, engine: LLMEngine, prompts, new_tokens: int) -> dict:
    """Prefill every prompt, then the decode rounds timed until all are done: a round's time is a step's."""
    params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    ids = [f"r{i}" for i in range(len(prompts))]
    for rid, prompt in zip(ids, prompts):
        engine.add_request(rid, prompt, params)
    produced, final, start, rounds = dict.fromkeys(ids, 0), {}, None, 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            produced[out.request_id] = len(out.token_ids)
            if out.finished:
                final[out.request_id] = out
        if start is None and all(produced.values()):
            sync(args.device)
            start = time.perf_counter()
        elif start is not None:
            rounds += 1
    sync(args.device)
    return {"step_ms": 1e3 * (time.perf_counter() - start) / max(rounds, 1),
            "outputs": [final[r].token_ids for r in ids]}


def decode_cells(args, result) -> None:
    for b in (1, 32):
        prompts = random_prompts(b, args.prompt_len, args.vocab, seed=b)
        outs = {}
        for graphs in (False, True):
            engine = make_engine(args, graphs)
            decode_run(args, engine, prompts, 8)  # warm-up: Triton compiles, graphs are captured
            runs = [decode_run(args, engine, prompts, args.new_tokens) for _ in range(args.reps)]
            key = f"decode_b{b}_{'graphs' if graphs else 'eager'}_ms"
            result["cells"][key] = statistics.median(r["step_ms"] for r in runs)
            result["cells"][key + "_spread"] = [min(r["step_ms"] for r in runs), max(r["step_ms"] for r in runs)]
            outs[graphs] = runs[-1]["outputs"]
            save(args, result)
        same = sum(a == b for x, y in zip(outs[False], outs[True]) for a, b in zip(x, y))
        result["cells"][f"graphs_equal_eager_b{b}"] = outs[False] == outs[True]
        result["cells"][f"graphs_eager_token_agreement_b{b}"] = same / sum(len(x) for x in outs[False])


def verify_cells(args, result) -> None:
    """One target forward over `b` trees of the hybrid default's rows each (T nodes, a root with K children)."""
    shape = SpecConfig("eagle3", draft_model="x")
    nodes = shape.num_draft_tokens
    parents = [-1] + [(i - 1) // shape.topk if i > shape.topk else 0 for i in range(1, nodes)]
    mask = torch.zeros(nodes, nodes, dtype=torch.bool)
    for i, p in enumerate(parents):
        if p >= 0:
            mask[i] = mask[p]
        mask[i, i] = True
    for graphs in (False, True):
        engine = make_engine(args, graphs, SpecConfig("ngram", spec_num_draft_tokens=nodes, spec_num_steps=nodes - 1,
                                                      spec_topk=2, spec_adaptive=False))
        runner = engine.runner
        for b in (1, 32):
            context = args.prompt_len
            pages = [runner.kv_pool.allocator.alloc(-(-(context + nodes) // 16)) for _ in range(b)]
            ids = random_prompts(1, b * nodes, args.vocab, seed=7)[0]
            depth = [0] + [1 + (p > 0) for p in parents[1:]]
            positions = [context + d for _ in range(b) for d in depth]
            call = lambda: runner.model.compute_logits(runner.forward(  # noqa: E731
                ids, positions, [nodes] * b, [context + nodes] * b, pages, [mask] * b)[0])
            with torch.inference_mode():
                for _ in range(3):
                    call()
                sync(args.device)
                start = time.perf_counter()
                for _ in range(args.iters):
                    call()
                sync(args.device)
            result["cells"][f"verify_b{b}_t{nodes}_{'graphs' if graphs else 'eager'}_ms"] = \
                1e3 * (time.perf_counter() - start) / args.iters
            for p in pages:
                runner.kv_pool.allocator.free(p)
        save(args, result)


def c1_run(args, engine: LLMEngine, prompts) -> dict:
    """One request at a time: TPOT per request (decode time over tokens after the first), τ over all."""
    params = SamplingParams(max_tokens=args.chat_tokens, temperature=0.0)
    tpots, outputs, verifies, accepted = [], [], 0, 0
    for i, prompt in enumerate(prompts):
        engine.add_request(f"c{i}", prompt, params)
        first = None
        while engine.has_unfinished_requests():
            for out in engine.step():
                if first is None and out.token_ids:
                    sync(args.device)
                    first, n_first = time.perf_counter(), len(out.token_ids)
                if out.finished:
                    sync(args.device)
                    if len(out.token_ids) > n_first:
                        tpots.append(1e3 * (time.perf_counter() - first) / (len(out.token_ids) - n_first))
                    outputs.append(out.token_ids)
                    verifies += out.spec_verify_count or 0
                    accepted += out.spec_accepted_tokens or 0
    return {"tpot_ms": statistics.median(tpots), "outputs": outputs,
            "tau": (accepted + verifies) / verifies if verifies else None}


def spec_cells(args, result, prompts: dict) -> None:
    if prompts is None:
        why = "needs the default model's weights and the held-out prompts staged (evals/gpu_stage.py)"
        result["errors"]["eagle3_chat_c1"] = result["errors"]["ngram_grounded_c1"] = why
        return
    head = args.random_head or "default"  # the shipped head; a smoke run on random weights: a random one
    for name, spec, workload in (("eagle3_chat_c1", SpecConfig("eagle3", draft_model=head), "chat"),
                                 ("ngram_grounded_c1", SpecConfig("ngram"), "grounded")):
        try:
            plain, spec_engine = make_engine(args, True), make_engine(args, True, spec)
            work = prompts[workload][:args.num_prompts]
            for engine in (plain, spec_engine):
                c1_run(args, engine, work[:2])  # warm-up
            reps = [(c1_run(args, plain, work), c1_run(args, spec_engine, work)) for _ in range(args.reps)]
            ratios = [p["tpot_ms"] / s["tpot_ms"] for p, s in reps]
            result["cells"][name] = {"plain_tpot_ms": statistics.median(p["tpot_ms"] for p, _ in reps),
                                     "spec_tpot_ms": statistics.median(s["tpot_ms"] for _, s in reps),
                                     "tpot_over_plain": statistics.median(ratios), "spread": [min(ratios), max(ratios)],
                                     "tau": reps[-1][1]["tau"], "prompts": len(work),
                                     "outputs_equal_plain": reps[-1][0]["outputs"] == reps[-1][1]["outputs"]}
        except Exception as e:  # noqa: BLE001 - a failed cell is a result; the others still run
            result["errors"][name] = repr(e)
        save(args, result)


def pd_cell(args, result) -> None:
    """P and D in process over real ZMQ and Mooncake, KV in device memory, against the unified engine."""
    try:
        import zmq  # noqa: F401
        from specpd.disagg.transfer import backend_available
        ok, why = backend_available("mooncake")
        if not ok:
            raise RuntimeError(f"mooncake does not load: {why}")
        if args.device == "cuda":
            import importlib.metadata
            try:
                importlib.metadata.distribution("mooncake-transfer-engine")
            except importlib.metadata.PackageNotFoundError:
                raise RuntimeError("only mooncake's non-cuda wheel is here: it cannot register GPU memory (stage "
                                   "the CUDA build: evals/gpu_stage.py --wheels)") from None
        from specpd.disagg.decode import DecodeWorker
        from specpd.disagg.prefill import PrefillWorker
        from tests.disagg.handoff_helpers import run_pd
        prompts = random_prompts(4, 40, args.vocab, seed=3)
        params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
        expected = [o.token_ids for o in make_engine(args, True).generate(prompts, params)]
        p = PrefillWorker(make_engine(args, True), "mooncake", bootstrap_port=0)
        d = DecodeWorker(make_engine(args, True), "mooncake")
        try:
            final = run_pd(p, d, prompts, params)
            result["cells"]["pd_equals_unified"] = [final[f"d{i}"].token_ids for i in range(4)] == expected
        finally:
            p.close()
            d.close()
    except Exception as e:  # noqa: BLE001
        result["errors"]["pd"] = f"not measured: {e!r}"
    save(args, result)


def judge(result) -> None:
    cells = result["cells"]
    measured = {"decode_b1_graphs_ms": cells.get("decode_b1_graphs_ms"),
                "decode_b32_graphs_ms": cells.get("decode_b32_graphs_ms"),
                "eagle3_chat_c1_tpot_over_plain": (cells.get("eagle3_chat_c1") or {}).get("tpot_over_plain"),
                "ngram_grounded_c1_tpot_over_plain": (cells.get("ngram_grounded_c1") or {}).get("tpot_over_plain"),
                "pd_equals_unified": cells.get("pd_equals_unified"),
                "graphs_equal_eager": (cells["graphs_equal_eager_b1"] and cells["graphs_equal_eager_b32"]
                                       if "graphs_equal_eager_b32" in cells else None)}
    for name, (op, bound) in TARGETS.items():
        value = measured[name]
        met = None if value is None else {"<=": value <= bound, ">=": value >= bound, "==": value == bound}[op]
        result["targets"][name] = {"target": f"{op} {bound}", "measured": value, "met": met}


def save(args, result) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w", encoding="utf-8") as f:
        json.dump(result, f, indent=1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--backend", default="triton")
    ap.add_argument("--model", help="the staged default model (a GGUF or HF directory); default: random weights")
    ap.add_argument("--prompts", help="the staged prompts.json (token ids of the chat and grounded workloads)")
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--chat-tokens", type=int, default=128)
    ap.add_argument("--num-prompts", type=int, default=16)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--num-pages", type=int, default=4096)
    ap.add_argument("--max-model-len", type=int, default=2048)
    ap.add_argument("--cells", default="decode,verify,spec,pd", help="which cells to run (a rerun of some)")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU: the code end to end, no numbers")
    ap.add_argument("--out", default=os.path.join(REPO_ROOT, "evals", "results", "gpu.json"))
    args = ap.parse_args()
    if args.smoke and args.out == ap.get_default("out"):
        args.out = os.path.join(tempfile.gettempdir(), "specpd_gpu_smoke.json")  # never the canonical file
    if args.smoke:
        args.device, args.dtype, args.backend = "cpu", "float32", "torch"
        args.prompt_len, args.new_tokens, args.chat_tokens, args.num_prompts = 24, 6, 8, 3
        args.reps, args.iters, args.num_pages, args.max_model_len = 1, 2, 1024, 256
    result = {"command": command_line(), "smoke": args.smoke, "machine": {**machine_info(), **versions()}, "cells": {},
              "targets": {}, "errors": {}}
    if args.device == "cuda":
        import triton
        result["machine"].update(gpu=torch.cuda.get_device_name(), cuda=torch.version.cuda, triton=triton.__version__)
    args.random_head = None
    with tempfile.TemporaryDirectory() as tmp:
        prompts = None
        if args.model is None:
            args.model = os.path.join(tmp, "target")
            save_random_target(args.model, TINY if args.smoke else SMOLLM2_135M)
            result["weights"] = "random, SmolLM2-135M's shape" if not args.smoke else "random, tiny"
        else:
            result["weights"] = args.model
        with open(os.path.join(args.model, "config.json") if os.path.isdir(args.model) else os.devnull) as f:
            args.vocab = json.loads(f.read() or "{}").get("vocab_size", SMOLLM2_135M["vocab_size"])
        if args.prompts:
            with open(args.prompts, encoding="utf-8") as f:
                prompts = json.load(f)
        elif args.smoke:  # the code path of the staged cells, on random weights and a random head
            from specpd.config import ModelConfig
            from specpd.spec.draft.loader import random_draft_checkpoint
            from specpd.model.loader import load_checkpoint
            args.random_head = os.path.join(tmp, "head")
            random_draft_checkpoint(args.random_head, "eagle3",
                                    ModelConfig.from_hf(load_checkpoint(args.model).hf_config), seed=1)
            prompts = {w: random_prompts(3, 20, args.vocab, seed=s) for s, w in enumerate(("chat", "grounded"))}
        result["target"] = args.model
        chosen = args.cells.split(",")
        for name, cells in (("decode", decode_cells), ("verify", verify_cells),
                            ("spec", lambda a, r: spec_cells(a, r, prompts)), ("pd", pd_cell)):
            if name in chosen:
                cells(args, result)
    judge(result)
    save(args, result)
    print(json.dumps({"cells": result["cells"], "targets": result["targets"], "errors": result["errors"]}, indent=1))


if __name__ == "__main__":
    main()
