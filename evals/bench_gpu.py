"""The engine on a CUDA GPU: decode, verify and speculative against plain decoding, per attention backend.

Run where a GPU is (the device machine of a session; CI never has one):

    TRITON_INTERPRET=0 python3 evals/bench_gpu.py            → evals/results/gpu.json

The default model's weights cannot travel to that machine (the GGUF is 94 MB; one call carries 64 MiB with
the repository), so the target is SmolLM2-135M's architecture with random weights (the same shapes, the same
work per step: 30 layers, 9 query / 3 KV heads, head dim 64, vocabulary 49152, tied head), built with HF
transformers there. Its greedy text is meaningless, so acceptance is set by construction, not learned:
  - plain: TPOT and output tok/s at batch 1, 8, 32, 64 (256-token prompts, 64 new tokens), per backend;
  - verify round cost: EAGLE-3 with the shipped head (it fits this architecture) pinned to its default
    shape; against random target weights nearly every draft is rejected, so TPOT here is the price of a
    speculating round that gains nothing (draft + tree verify + commit) over a plain step;
  - replay: a chain of depth 3 replaying the target's own greedy output (every draft accepted, τ = 4): the
    round's gain when drafts are right;
  - ngram with its defaults and the adaptive policy not pinned: what a user's flag gets on this text.
Each cell: a warm-up run, then `--reps` timed runs; medians and the spread. `--device cpu --quick` is a dry
run of the same code on the host.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
EVALS_DIR = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [EVALS_DIR, os.path.dirname(EVALS_DIR)]

import torch  # noqa: E402

from common import REPO_ROOT, machine_info, versions  # noqa: E402
from specpd.config import CacheConfig, EngineConfig, SchedulerConfig, SpecConfig  # noqa: E402
from specpd.core import SamplingParams  # noqa: E402
from specpd.draft.loader import resolve_draft_path  # noqa: E402
from specpd.engine.llm_engine import LLMEngine  # noqa: E402

SMOLLM2_135M = dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                    num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=8192,
                    rope_theta=100000.0, rms_norm_eps=1e-5, tie_word_embeddings=True,
                    bos_token_id=1, eos_token_id=2)
TINY = dict(SMOLLM2_135M, num_hidden_layers=4, vocab_size=2048, max_position_embeddings=1024)


def save_random_target(path: str, config: dict, seed: int = 0) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(seed)
    model = LlamaForCausalLM(LlamaConfig(**config))
    model.save_pretrained(path, safe_serialization=True)


def prompts_for(batch: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (length,), generator=gen).tolist() for _ in range(batch)]


def make_engine(args, model: str, backend: str, spec: SpecConfig | None = None) -> LLMEngine:
    return LLMEngine(EngineConfig(model=model, device=args.device, dtype=args.dtype, attention_backend=backend,
                                  cache=CacheConfig(page_size=16, num_pages=args.num_pages),
                                  scheduler=SchedulerConfig(max_running_requests=128),
                                  spec=spec or SpecConfig()))


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def timed_run(args, engine: LLMEngine, prompts, new_tokens: int, references=None) -> dict:
    """Prefill every prompt, then time the decode rounds until all are done."""
    params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    ids = [f"r{i}" for i in range(len(prompts))]
    for i, (rid, prompt) in enumerate(zip(ids, prompts)):
        if references is not None:
            engine.spec_runner.proposer.references[rid] = references[i]
        engine.add_request(rid, prompt, params)
    produced = {rid: 0 for rid in ids}
    final = {}
    t_decode = None
    rounds = 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            produced[out.request_id] = len(out.token_ids)
            if out.finished:
                final[out.request_id] = out
        if t_decode is None and all(produced.values()):  # every request has its first token: decode starts
            sync(args.device)
            t_decode, first = time.perf_counter(), sum(produced.values())
        elif t_decode is not None:
            rounds += 1
    sync(args.device)
    elapsed = time.perf_counter() - t_decode
    tokens = sum(len(final[r].token_ids) for r in ids) - first
    verifies = sum(final[r].spec_verify_count for r in ids)
    accepted = sum(final[r].spec_accepted_tokens for r in ids)
    return {"decode_s": elapsed, "decode_tokens": tokens, "rounds": rounds,
            "tpot_ms": 1e3 * elapsed / (tokens / len(ids)), "tok_s": tokens / elapsed,
            "round_ms": 1e3 * elapsed / max(rounds, 1),
            "tau": (accepted + verifies) / verifies if verifies else None,
            "outputs": [final[r].token_ids for r in ids]}


def cell(args, engine, prompts, references=None) -> dict:
    timed_run(args, engine, prompts, min(args.new_tokens, 8), references)  # warm-up: Triton compiles here
    runs = [timed_run(args, engine, prompts, args.new_tokens, references) for _ in range(args.reps)]
    assert engine.free_pages == args.num_pages, "pages leaked"
    out = {k: statistics.median(r[k] for r in runs) for k in ("tpot_ms", "tok_s", "round_ms")}
    out["tpot_ms_spread"] = [min(r["tpot_ms"] for r in runs), max(r["tpot_ms"] for r in runs)]
    out["tau"] = runs[-1]["tau"]
    out["outputs"] = runs[-1]["outputs"]
    return out


def machine(device: str) -> dict:
    """evals/common's machine and versions, plus the accelerator and Triton."""
    info = {**machine_info(), **versions()}
    try:
        import triton
        info["triton"] = triton.__version__
    except ImportError:
        info["triton"] = None
    if device == "cuda":
        info["gpu"] = torch.cuda.get_device_name()
        info["cuda"] = torch.version.cuda
    return info


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--backends", default="triton,torch")
    ap.add_argument("--batches", default="1,8,32,64")
    ap.add_argument("--spec-batches", default="1,8,32")
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--num-pages", type=int, default=4096)
    ap.add_argument("--quick", action="store_true", help="a 4-layer model and small cells (a dry run on a CPU)")
    ap.add_argument("--out", default=os.path.join(REPO_ROOT, "evals", "results", "gpu.json"))
    ap.add_argument("--merge", action="store_true", help="add these cells to --out's (keys carry dtype/backend)")
    args = ap.parse_args()
    config = TINY if args.quick else SMOLLM2_135M
    result = {"commands": [], "machine": machine(args.device), "target": config, "plain": {}, "spec": {},
              "errors": {}}
    if args.merge and os.path.exists(args.out):
        with open(args.out, encoding="utf-8") as f:
            result = json.load(f)
    result["commands"].append(" ".join(sys.argv))
    dt = {"bfloat16": "bf16", "float32": "fp32", "float16": "fp16"}.get(args.dtype, args.dtype)

    def save():
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w", encoding="utf-8") as f:
            json.dump(result, f, indent=1)

    with tempfile.TemporaryDirectory() as model:
        save_random_target(model, config)
        head = resolve_draft_path("default", "eagle3") if not args.quick else None
        for backend in args.backends.split(","):
            for key in [k for k in result["errors"] if k.startswith(f"{dt}/") and k.endswith(f"/{backend}")]:
                del result["errors"][key]  # a merged rerun replaces the earlier run's failure
            plain_out = {}
            try:
                engine = make_engine(args, model, backend)
                for b in map(int, args.batches.split(",")):
                    c = cell(args, engine, prompts_for(b, args.prompt_len, config["vocab_size"], b))
                    plain_out[b] = c.pop("outputs")
                    result["plain"][f"{dt}/{backend}/b{b}"] = c
                    print(f"plain {dt} {backend} b{b}: {json.dumps(c)}", flush=True)
                    save()
                del engine
            except Exception as e:  # noqa: BLE001 - a broken backend is a result; the others still run
                result["errors"][f"{dt}/plain/{backend}"] = repr(e)
                print(f"plain {backend} FAILED: {e!r}", flush=True)
                save()
                continue
            specs = {"replay_chain3": SpecConfig("replay", spec_num_steps=3, spec_topk=1,
                                                 spec_adaptive_pinned=True),
                     "ngram_defaults": SpecConfig("ngram")}
            if head is not None:
                specs["eagle3_pinned_default_shape"] = SpecConfig("eagle3", draft_model=head, spec_ngram=False,
                                                                  spec_adaptive_pinned=True)
            for name, spec in specs.items():
                try:
                    engine = make_engine(args, model, backend, spec)
                    for b in map(int, args.spec_batches.split(",")):
                        prompts = prompts_for(b, args.prompt_len, config["vocab_size"], b)
                        refs = plain_out.get(b) if name.startswith("replay") else None
                        c = cell(args, engine, prompts, refs)
                        outs = c.pop("outputs")
                        if b in plain_out:  # lossless: greedy equals plain, at any batch
                            c["greedy_equals_plain"] = outs == plain_out[b]
                        p = result["plain"].get(f"{dt}/{backend}/b{b}")
                        if p:
                            c["tok_s_over_plain"] = c["tok_s"] / p["tok_s"]
                            c["round_over_plain_step"] = c["round_ms"] / p["round_ms"]
                        result["spec"][f"{dt}/{backend}/{name}/b{b}"] = c
                        print(f"spec {dt} {backend} {name} b{b}: {json.dumps(c)}", flush=True)
                        save()
                    del engine
                except Exception as e:  # noqa: BLE001
                    result["errors"][f"{dt}/{name}/{backend}"] = repr(e)
                    print(f"spec {backend} {name} FAILED: {e!r}", flush=True)
                    save()
    save()
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
