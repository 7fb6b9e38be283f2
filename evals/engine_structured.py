"""Constrained vs unconstrained decoding on the default model (SmolLM2-135M-Instruct), CPU: TPOT, tau, and
the grammar's share of each step.

Prompts: JSON-schema extraction requests built from the first human turn of held-out ShareGPT
conversations (never trained on). Configs: `base` (no speculation) and `tree8` (the shipped EAGLE-3
head, S=3, topk 4, 8 nodes; adaptive policy pinned so tau compares like with like), each constrained
(the EXTRACT schema) and unconstrained, at each batch size. Greedy.
  TPOT        = (wall - TTFT) / (output tokens - 1) per request, median over the batch
  tau         = tokens committed per verify forward (bonus included), all requests
  mask share  = time filling and applying grammar masks (target rows, tree nodes, draft proposals)
                / wall time of the decode steps
  valid       = constrained outputs that finished and validate against the schema

  python -m evals.engine_structured                 # -> evals/results/engine_structured.json
  python -m evals.engine_structured --quick         # smoke run -> $TMPDIR
"""
from __future__ import annotations

import argparse
import json
import os
import tempfile
import time

from evals.harness.prompts import chat_prompt, held_out_first_turns
from evals.harness.results import log, machine_info, median, versions, write_json

EXTRACT = {"type": "object", "properties": {
    "topic": {"type": "string", "maxLength": 40},
    "language": {"enum": ["english", "chinese", "spanish", "other"]},
    "is_question": {"type": "boolean"},
    "keywords": {"type": "array", "items": {"type": "string", "maxLength": 16}, "maxItems": 3}},
    "required": ["topic", "language", "is_question", "keywords"]}


def extraction_prompts(tokenizer, num: int) -> list[list[int]]:
    prompts = []
    for text in held_out_first_turns():
        text = text[:600]
        prompts.append(chat_prompt(tokenizer, "Extract the topic, language, whether it is a question and up to "
                                              f"three keywords from this message, as JSON:\n\n{text}"))
        if len(prompts) == num:
            return prompts
    return prompts


def run(engine, prompts, params) -> dict:
    ids = [f"r{i}-{time.monotonic_ns()}" for i in range(len(prompts))]
    stats0 = engine.stats().get("grammar_mask_seconds", 0.0)
    t0 = time.perf_counter()
    for rid, prompt in zip(ids, prompts):
        engine.add_request(rid, prompt, params)
    first, final, decode_s = {}, {}, 0.0
    while engine.has_unfinished_requests():
        ts = time.perf_counter()
        outs = engine.step()
        if len(first) == len(ids):
            decode_s += time.perf_counter() - ts
        for out in outs:
            first.setdefault(out.request_id, time.perf_counter() - t0)
            if out.finished:
                final[out.request_id] = (out, time.perf_counter() - t0)
    mask_s = engine.stats().get("grammar_mask_seconds", 0.0) - stats0
    tpot = [(end - first[rid]) / (len(out.token_ids) - 1) for rid, (out, end) in final.items() if len(out.token_ids) > 1]
    outs = [final[rid][0] for rid in ids]
    verifies = sum(o.spec_verify_count for o in outs)
    return {"tpot_ms": 1e3 * median(tpot), "tau": sum(o.spec_committed_tokens for o in outs) / verifies if verifies else None,
            "mask_share": mask_s / decode_s if decode_s else 0.0,
            "output_tokens": sum(len(o.token_ids) for o in outs), "outputs": outs}


def valid(out) -> bool:
    import jsonschema
    try:
        jsonschema.validate(json.loads(out.text), EXTRACT)
        return out.finish_reason == "stop"
    except (ValueError, jsonschema.ValidationError):
        return False


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--output", default=None)
    args = ap.parse_args()
    if args.quick:
        args.batch_sizes, args.max_tokens = [1, 2], 24
    out_path = args.output or (os.path.join(tempfile.gettempdir(), "engine_structured.json") if args.quick
                               else os.path.join(os.path.dirname(__file__), "results", "engine_structured.json"))
    from specpd.config import CacheConfig, EngineConfig, SpecConfig
    from specpd.core import SamplingParams
    from specpd.engine.llm_engine import LLMEngine
    from specpd.model.loader import load_checkpoint
    ckpt = load_checkpoint("default")
    prompts = extraction_prompts(ckpt.tokenizer, max(args.batch_sizes))
    configs = {"base": SpecConfig(),
               "tree8": SpecConfig("eagle3", draft_model="default", spec_num_steps=3, spec_topk=4,
                                   spec_num_draft_tokens=8, spec_adaptive_pinned=True, spec_ngram=False)}
    constrained = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, constraint_kind="json_schema",
                                 constraint_spec=json.dumps(EXTRACT))
    free = SamplingParams(max_tokens=args.max_tokens, temperature=0.0)
    results = []
    for name, spec in configs.items():
        engine = LLMEngine(EngineConfig(model="default", cache=CacheConfig(page_size=16, num_pages=512), spec=spec),
                           checkpoint=ckpt)
        engine.generate(prompts[:1], SamplingParams(max_tokens=4, temperature=0.0))  # warm-up
        for bs in args.batch_sizes:
            for label, params in (("unconstrained", free), ("constrained", constrained)):
                r = run(engine, prompts[:bs], params)
                outs = r.pop("outputs")
                row = {"config": name, "batch": bs, "mode": label, **r}
                if label == "constrained":
                    row["valid"] = f"{sum(valid(o) for o in outs)}/{len(outs)}"
                    row["finish_reasons"] = [o.finish_reason for o in outs]
                log(json.dumps(row))
                results.append(row)
    write_json(out_path, {"machine": machine_info(), "versions": versions(), "max_tokens": args.max_tokens,
                          "schema": EXTRACT, "results": results})
    log("wrote", out_path)


if __name__ == "__main__":
    main()
