"""specpd's plain decoding against HF transformers' `generate` on the same weights, one request at a time.

    .venv/bin/python -m evals.engine_hf            → evals/results/engine_hf.json

The default model from specpd's converted copy (evals/peers_servers.py `hf_dir`, the directory vLLM loads), fp32 (the
issue's bar: plain decode ≥ 1.5× HF `generate` at batch 1 in fp32; `--dtypes float32,bfloat16` adds bf16), at
the thread count `specpd serve` picks here, in one process: HF `generate` (greedy, no EOS id: it neither
stops nor masks EOS, as specpd's `ignore_eos`; its default SDPA attention and dynamic cache) and an `LLMEngine` with
the defaults but for the dtype, on held-out chat prompts, in rotated order per prompt. A run's decode rate is
(output tokens - 1) over the time after the first token: HF's first token is timed by a `generate` of one new
token on the same prompt just before; specpd's is when its first output arrives. Per prompt the ratio of the two
rates; the JSON holds the medians, the spread and whether the greedy tokens agree (fp32: they must).
"""
from __future__ import annotations

import argparse
import os
import statistics
import time

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import torch

from evals.harness.prompts import held_out_sharegpt_prompts
from evals.harness.results import command_line, log, machine_info, versions, write_json
from evals.peers_servers import hf_dir

from specpd.config import EngineConfig
from specpd.core import SamplingParams
from specpd.engine.llm_engine import LLMEngine
from specpd.machine import default_threads
from specpd.model.loader import load_checkpoint


def hf_run(model, prompt: list[int], n: int) -> tuple[list[int], float]:
    """(tokens, decode tokens/s) of HF generate."""
    from transformers import GenerationConfig
    ids = torch.tensor([prompt])
    mask = torch.ones_like(ids)

    def config(new: int):  # no EOS: it neither stops nor is masked (specpd's ignore_eos samples it and goes on)
        return GenerationConfig(max_new_tokens=new, do_sample=False, eos_token_id=None, pad_token_id=0)
    with torch.inference_mode():
        t0 = time.perf_counter()
        model.generate(ids, generation_config=config(1), attention_mask=mask)
        first = time.perf_counter() - t0
        t0 = time.perf_counter()
        out = model.generate(ids, generation_config=config(n), attention_mask=mask)
        total = time.perf_counter() - t0
    tokens = out[0, len(prompt):].tolist()
    if len(tokens) != n:
        raise RuntimeError(f"HF generate stopped after {len(tokens)} of {n} tokens")
    return tokens, (n - 1) / (total - first)


def specpd_run(engine: LLMEngine, prompt: list[int], n: int, rid: str) -> tuple[list[int], float]:
    """(tokens, decode tokens/s) of one request through the engine's steps."""
    engine.add_request(rid, prompt, SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True))
    t0 = time.perf_counter()
    first = None
    tokens: list[int] = []
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.new_token_ids and first is None:
                first = time.perf_counter()
            if out.finished:
                tokens = out.token_ids
    end = time.perf_counter()
    assert first is not None and first > t0 and engine.free_pages == engine.total_pages
    return tokens, (len(tokens) - 1) / (end - first)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--output-len", type=int, default=96)
    ap.add_argument("--dtypes", default="float32", help="comma-separated: float32, bfloat16")
    ap.add_argument("--threads", type=int, default=default_threads(),
                    help="torch threads (default: what `specpd serve` picks here, every usable core)")
    ap.add_argument("--out", default="evals/results/engine_hf.json")
    args = ap.parse_args()
    from transformers import AutoModelForCausalLM
    torch.set_num_threads(args.threads)
    ckpt = load_checkpoint("default")
    prompts = held_out_sharegpt_prompts(ckpt.tokenizer, args.prompts + 1)
    result = {"description": __doc__.split("\n\n")[0], "command": command_line(),
              "args": vars(args), "machine": machine_info(), "versions": versions(), "dtypes": {}}
    for name in args.dtypes.split(","):
        dtype = getattr(torch, name)
        hf = AutoModelForCausalLM.from_pretrained(hf_dir(), dtype=dtype).eval()
        hf.generation_config.eos_token_id = None  # (generate merges the model's own config into the one given)
        engine = LLMEngine(EngineConfig(model="default", dtype=name, num_threads=args.threads), checkpoint=ckpt)
        hf_run(hf, prompts[0], 8)  # warm both
        specpd_run(engine, prompts[0], 8, "warm")
        rows = []
        for i, prompt in enumerate(prompts[1:]):
            runs = {}
            order = ("hf", "specpd") if i % 2 == 0 else ("specpd", "hf")
            for who in order:
                runs[who] = (hf_run(hf, prompt, args.output_len) if who == "hf"
                             else specpd_run(engine, prompt, args.output_len, f"p{i}"))
            rows.append({"prompt_tokens": len(prompt), "hf_tok_s": runs["hf"][1], "specpd_tok_s": runs["specpd"][1],
                         "ratio": runs["specpd"][1] / runs["hf"][1], "same_tokens": runs["hf"][0] == runs["specpd"][0]})
            log(name, i, {k: round(v, 3) if isinstance(v, float) else v for k, v in rows[-1].items()})
        ratios = [r["ratio"] for r in rows]
        result["dtypes"][name] = {
            "hf_decode_tok_s": statistics.median(r["hf_tok_s"] for r in rows),
            "specpd_decode_tok_s": statistics.median(r["specpd_tok_s"] for r in rows),
            "ratio_median": statistics.median(ratios), "ratio_spread": [min(ratios), max(ratios)],
            "greedy_tokens_equal": sum(r["same_tokens"] for r in rows), "prompts": len(rows), "per_prompt": rows}
        log(name, {k: v for k, v in result["dtypes"][name].items() if k != "per_prompt"})
        del hf, engine
    write_json(args.out, result)


if __name__ == "__main__":
    main()
