"""The training loop: batches from the feature cache, AdamW, checkpoints, resume.

1. `plan_epoch` lays out one epoch as batches, deterministically from (seed, epoch): chunks in a
   shuffled order, each chunk's conversations shuffled, grouped by length and packed under a padded
   token budget. Step n of the run is batch n % steps_per_epoch of epoch n // steps_per_epoch, so
   a resumed run replays nothing and skips nothing.
2. `Trainer.train` runs the steps: collate -> DraftObjective -> backward -> clip -> AdamW step;
   the learning rate warms up linearly, then decays on a cosine to 0 over the whole run
   (epochs x steps_per_epoch; --max-steps only stops early and leaves the schedule unchanged).
3. Every `checkpoint_every` steps and at the end: OUT/checkpoint.pt (draft, optimiser, scheduler,
   step) for --resume, and OUT/config.json + OUT/model.safetensors in the published layout, so the
   directory is a usable draft at every checkpoint. Metrics go to OUT/train_log.jsonl.
"""
from __future__ import annotations

import json
import math
import os
import random
import time
from dataclasses import asdict, dataclass
from typing import Any

import torch

from specpd.spec.draft.base import DraftModel
from specpd.spec.draft.loader import save_draft_model
from specpd.train.features import FeatureCache
from specpd.train.objective import DraftObjective, TrainBatch

CHECKPOINT = "checkpoint.pt"
LOG = "train_log.jsonl"


@dataclass(frozen=True)
class TrainConfig:
    lr: float = 3e-4
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.95)
    warmup_fraction: float = 0.02
    max_grad_norm: float = 0.5
    batch_tokens: int = 4096  # padded tokens per batch (rows x longest row)
    epochs: int = 1
    max_steps: int | None = None  # stop early; the LR schedule still spans all epochs
    checkpoint_every: int = 200
    log_every: int = 10
    seed: int = 0
    progress: bool = True


def plan_epoch(seq_lens: list[list[int]], batch_tokens: int, seed: int, epoch: int,
               group: int = 64) -> list[tuple[int, list[int]]]:
    """-> [(chunk index, conversation indices in that chunk)] for one epoch."""
    rng = random.Random(f"{seed}:{epoch}")
    chunks = list(range(len(seq_lens)))
    rng.shuffle(chunks)
    plan: list[tuple[int, list[int]]] = []
    for c in chunks:
        order = list(range(len(seq_lens[c])))
        rng.shuffle(order)
        batches: list[list[int]] = []
        for g in range(0, len(order), group):  # sort within groups of `group`: little padding, still shuffled
            batch: list[int] = []
            longest = 0
            for i in sorted(order[g:g + group], key=lambda i: seq_lens[c][i]):
                n = seq_lens[c][i]
                if batch and max(longest, n) * (len(batch) + 1) > batch_tokens:
                    batches.append(batch)
                    batch, longest = [], 0
                batch.append(i)
                longest = max(longest, n)
            if batch:
                batches.append(batch)
        rng.shuffle(batches)
        plan.extend((c, b) for b in batches)
    return plan


class Trainer:
    def __init__(self, draft: DraftModel, objective: DraftObjective, cache: FeatureCache, out_dir: str,
                 config: TrainConfig, run_spec: dict[str, Any], hot_token_ids: torch.Tensor | None):
        """run_spec: what must not change across --resume (algorithm, target, features, ...)."""
        self.draft = draft
        self.objective = objective
        self.cache = cache
        self.out_dir = out_dir
        self.config = config
        self.run_spec = {**run_spec, "train": {k: v for k, v in asdict(config).items()
                                               if k not in ("max_steps", "checkpoint_every", "log_every", "progress")}}
        self.hot_token_ids = hot_token_ids
        self.feature_key = "aux" if draft.aux_layer_ids else "hidden"
        self.seq_lens = [c["seq_lens"] for c in cache.chunks]
        self.steps_per_epoch = len(plan_epoch(self.seq_lens, config.batch_tokens, config.seed, 0))
        self.total_steps = self.steps_per_epoch * config.epochs
        params = [p for p in draft.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(params, lr=config.lr, betas=config.betas,
                                           weight_decay=config.weight_decay)
        warmup = max(1, int(config.warmup_fraction * self.total_steps))
        total = self.total_steps

        def lr_factor(step: int) -> float:
            if step < warmup:
                return (step + 1) / warmup
            return 0.5 * (1.0 + math.cos(math.pi * min(1.0, (step - warmup) / max(1, total - warmup))))

        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lr_factor)
        self.step = 0
        self._epoch_plan: tuple[int, list] | None = None
        self._chunk: tuple[int, dict, list[int]] | None = None

    # -- data ------------------------------------------------------------------------------------
    def batch_at(self, step: int) -> TrainBatch:
        epoch, i = divmod(step, self.steps_per_epoch)
        if self._epoch_plan is None or self._epoch_plan[0] != epoch:
            self._epoch_plan = (epoch, plan_epoch(self.seq_lens, self.config.batch_tokens, self.config.seed, epoch))
        plan = self._epoch_plan[1]
        # an epoch's shuffle can pack into a batch or two more or fewer than epoch 0's (steps_per_epoch):
        # a shorter epoch repeats its first batches, a longer one drops its last
        chunk, seqs = plan[i % len(plan)]
        if self._chunk is None or self._chunk[0] != chunk:
            names = ("input_ids", "loss_mask", "target_argmax", "hidden") + (
                ("aux",) if self.feature_key == "aux" else ())
            tensors = self.cache.load(chunk, names)
            starts = [0]
            for n in self.seq_lens[chunk]:
                starts.append(starts[-1] + n)
            self._chunk = (chunk, tensors, starts)
        _, tensors, starts = self._chunk
        rows = [{name: t[starts[j]:starts[j + 1]] for name, t in tensors.items()} for j in seqs]
        return TrainBatch.collate(rows, self.feature_key)

    # -- loop ------------------------------------------------------------------------------------
    def train_step(self, batch: TrainBatch) -> dict[str, float]:
        self.draft.train()
        loss, metrics = self.objective(batch)
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        params = [p for g in self.optimizer.param_groups for p in g["params"]]
        metrics["grad_norm"] = float(torch.nn.utils.clip_grad_norm_(params, self.config.max_grad_norm))
        self.optimizer.step()
        self.scheduler.step()
        self.step += 1
        return metrics

    def train(self) -> dict[str, float]:
        from tqdm import tqdm

        cfg = self.config
        end = self.total_steps if cfg.max_steps is None else min(self.total_steps, cfg.max_steps)
        bar = tqdm(total=end, initial=self.step, desc=f"train {self.draft.algorithm}", unit="step",
                   disable=not cfg.progress, dynamic_ncols=True)
        window_tokens, window_start = 0, time.perf_counter()
        metrics: dict[str, float] = {}
        while self.step < end:
            batch = self.batch_at(self.step)
            metrics = self.train_step(batch)
            window_tokens += batch.num_tokens
            elapsed = time.perf_counter() - window_start
            metrics.update(tokens_per_s=window_tokens / max(elapsed, 1e-9), lr=self.scheduler.get_last_lr()[0])
            bar.update(1)
            bar.set_postfix(loss=f"{metrics['loss']:.3f}", acc0=f"{metrics['acc0']:.3f}",
                            tok_s=f"{metrics['tokens_per_s']:.0f}", refresh=False)
            if self.step % cfg.log_every == 0 or self.step == end:
                self._log({"step": self.step, "epoch": (self.step - 1) // self.steps_per_epoch, **metrics})
                window_tokens, window_start = 0, time.perf_counter()
            if self.step % cfg.checkpoint_every == 0 or self.step == end:
                self.save()
        bar.close()
        return metrics

    def _log(self, record: dict) -> None:
        with open(os.path.join(self.out_dir, LOG), "a", encoding="utf-8") as f:
            f.write(json.dumps(record) + "\n")

    # -- checkpoints -----------------------------------------------------------------------------
    def save(self) -> None:
        os.makedirs(self.out_dir, exist_ok=True)
        state = {"step": self.step, "run_spec": self.run_spec, "draft": self.draft.state_dict(),
                 "optimizer": self.optimizer.state_dict(), "scheduler": self.scheduler.state_dict(),
                 "hot_token_ids": self.hot_token_ids}
        tmp = os.path.join(self.out_dir, CHECKPOINT + ".tmp")
        torch.save(state, tmp)
        os.replace(tmp, os.path.join(self.out_dir, CHECKPOINT))
        save_draft_model(self.draft, self.out_dir)

    def resume(self) -> bool:
        """Load OUT/checkpoint.pt if there is one; False when starting fresh."""
        path = os.path.join(self.out_dir, CHECKPOINT)
        if not os.path.isfile(path):
            return False
        state = torch.load(path, map_location="cpu", weights_only=False)
        if state["run_spec"] != self.run_spec:
            old, new = state["run_spec"], self.run_spec
            diff = sorted(k for k in set(old) | set(new) if old.get(k) != new.get(k))
            raise ValueError(f"--resume: {path} was written by a run with different settings ({diff}: "
                             f"checkpoint {[old.get(k) for k in diff]}, now {[new.get(k) for k in diff]})")
        self.draft.load_state_dict(state["draft"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        self.step = state["step"]
        return True

