"""Target features for draft training, computed by specpd's own runtime and cached to disk.

1. `target_runner()` builds a ModelRunner (CausalLM + paged KV pool + torch attention backend), the
   same code that serves the target.
2. `extract_features()` packs consecutive conversations into batches of at most `batch_tokens`
   tokens (a longer conversation goes alone) within the runner's KV pages, runs one full-prefill
   forward per batch with capture_layers = the draft's aux layers, and appends the
   results to safetensors chunks of about `chunk_tokens` tokens.
3. `FeatureCache` reads the chunks back for the trainer.

A chunk holds, for its N tokens over n conversations:
    input_ids [N] int32, loss_mask [N] uint8, seq_lens [n] int64,
    hidden [N, H]        the target's normed final hidden (EAGLE-1 / MTP input; and, through the
                         frozen LM head, the target's next-token distribution for every family),
    target_argmax [N] int32  the target's top-1 token after each position over its full vocab
                         (the reduced-vocab position mask and the accuracy metric need it),
    aux    [N, A * H]    EAGLE-3 only: the INPUT hiddens of the A aux layers, ascending, concatenated.
Features are stored in bfloat16 whatever the compute dtype (half the disk of fp32; SpecForge and
the EAGLE reference train from bf16 targets too). Next-token distributions are not stored: a 49k
vocab row per token is ~100x the hidden's size; the trainer recomputes them from `hidden` with
the frozen head (one [rows, H] x [H, V] matmul per batch).

index.json records what the cache was built from (`spec`) and its chunks; extraction resumes after
the last complete chunk, and a cache built from a different spec is refused, never mixed; one built
for more tokens or with aux layers serves a run that needs a prefix of it or no aux (`serves`), so
`--feature-dir` of an EAGLE-3 run trains MTP / EAGLE heads and smaller-budget runs.
"""
from __future__ import annotations

import itertools
import json
import os
from dataclasses import dataclass
from typing import Any, Iterable, Iterator

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from specpd.attention.metadata import AttentionMetadata
from specpd.kv.allocator import pages_needed
from specpd.train.data import TokenizedConversation

STORE_DTYPE = torch.bfloat16
INDEX = "index.json"
PAGE_SIZE = 16


def page_budget(batch_tokens: int, max_len: int) -> int:
    """KV pages one extraction batch may use (`_batches` keeps every batch within it)."""
    return pages_needed(max(batch_tokens, max_len), PAGE_SIZE) + 64


def target_runner(model: str, dtype: str, max_len: int, batch_tokens: int, checkpoint=None):
    """A ModelRunner for `model` with KV pages for one extraction batch."""
    from specpd.config import CacheConfig, EngineConfig
    from specpd.model.loader import load_checkpoint
    from specpd.model.runner import ModelRunner

    checkpoint = checkpoint or load_checkpoint(model)
    cache = CacheConfig(page_size=PAGE_SIZE, num_pages=page_budget(batch_tokens, max_len))
    return ModelRunner(EngineConfig(model=model, dtype=dtype, cache=cache), checkpoint, max_len), checkpoint


@torch.inference_mode()
def target_features(runner, seqs: list[list[int]], aux_layer_ids: tuple[int, ...]
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """One batched forward over whole sequences -> (hidden [N, H], target_argmax [N],
    aux [N, A * H] or None), sequences concatenated in order."""
    allocator = runner.kv_pool.allocator
    pages = [allocator.alloc(pages_needed(len(s), runner.kv_pool.page_size)) for s in seqs]
    try:
        lens = [len(s) for s in seqs]
        meta = AttentionMetadata.build(q_lens=lens, kv_lens=lens, page_lists=pages,
                                       page_size=runner.kv_pool.page_size, device=runner.device)
        runner.backend.plan(meta)
        ids = torch.tensor([t for s in seqs for t in s], dtype=torch.long, device=runner.device)
        positions = torch.cat([torch.arange(n) for n in lens]).to(runner.device)
        hidden, captured = runner.model(ids, positions, runner.backend, meta, capture_layers=aux_layer_ids)
    finally:
        for p in pages:
            allocator.free(p)
    aux = torch.cat(captured, dim=-1) if aux_layer_ids else None
    # full-vocab logits in blocks: [rows, vocab] fp32 for a whole batch would be GBs
    argmax = torch.cat([runner.model.compute_logits(block).argmax(-1) for block in hidden.split(512)])
    return hidden, argmax, aux


def _batches(convs: Iterable[TokenizedConversation], batch_tokens: int, max_pages: int
             ) -> Iterator[list[TokenizedConversation]]:
    """Consecutive conversations, up to `batch_tokens` tokens and `max_pages` KV pages a batch."""
    batch: list[TokenizedConversation] = []
    tokens = pages = 0
    for conv in convs:
        n = len(conv.input_ids)
        if batch and (tokens + n > batch_tokens or pages + pages_needed(n, PAGE_SIZE) > max_pages):
            yield batch
            batch, tokens, pages = [], 0, 0
        batch.append(conv)
        tokens += n
        pages += pages_needed(n, PAGE_SIZE)
    if batch:
        yield batch


def extract_features(runner, conversations: Iterable[TokenizedConversation], cache_dir: str,
                     spec: dict[str, Any], aux_layer_ids: tuple[int, ...], batch_tokens: int = 4096,
                     chunk_tokens: int = 65536, progress: bool = True) -> "FeatureCache":
    """Run the target over `conversations` and write the chunks; resumes a partial cache of the
    same spec (the conversation stream must be deterministic: it is replayed and skipped)."""
    from tqdm import tqdm

    os.makedirs(cache_dir, exist_ok=True)
    index = _read_index(cache_dir, spec) or {"spec": spec, "chunks": [], "complete": False}
    if index["complete"]:
        return FeatureCache(cache_dir, spec)
    done = sum(len(c["ids"]) for c in index["chunks"])
    bar = tqdm(desc="target features", unit="tok", disable=not progress, dynamic_ncols=True,
               initial=sum(sum(c["seq_lens"]) for c in index["chunks"]))
    pending: list[tuple[list[TokenizedConversation], dict[str, torch.Tensor]]] = []  # per batch

    def flush() -> None:
        if not pending:
            return
        convs = [c for batch, _ in pending for c in batch]
        tensors = {"input_ids": torch.tensor([t for c in convs for t in c.input_ids], dtype=torch.int32),
                   "loss_mask": torch.tensor([m for c in convs for m in c.loss_mask], dtype=torch.uint8),
                   "seq_lens": torch.tensor([len(c.input_ids) for c in convs], dtype=torch.int64)}
        for key in pending[0][1]:
            tensors[key] = torch.cat([out[key] for _, out in pending]).contiguous()
        name = f"chunk_{len(index['chunks']):05d}.safetensors"
        save_file(tensors, os.path.join(cache_dir, name))
        index["chunks"].append({"file": name, "ids": [c.id for c in convs],
                                "seq_lens": [len(c.input_ids) for c in convs]})
        _write_index(cache_dir, index)
        pending.clear()

    todo = itertools.islice(conversations, done, None)
    for batch in _batches(todo, batch_tokens, runner.kv_pool.num_pages):
        hidden, argmax, aux = target_features(runner, [c.input_ids for c in batch], aux_layer_ids)
        out = {"hidden": hidden.to(STORE_DTYPE), "target_argmax": argmax.to(torch.int32)}
        if aux is not None:
            out["aux"] = aux.to(STORE_DTYPE)
        pending.append((batch, out))
        bar.update(sum(len(c.input_ids) for c in batch))
        if sum(len(c.input_ids) for b, _ in pending for c in b) >= chunk_tokens:
            flush()
    flush()
    bar.close()
    if not index["chunks"]:
        raise ValueError("no training conversations: the dataset is empty after the held-out split and filters")
    index["complete"] = True
    _write_index(cache_dir, index)
    return FeatureCache(cache_dir, spec)


def open_cache(cache_dir: str, spec: dict[str, Any]) -> "FeatureCache | None":
    """The complete cache built from `spec`, or None (missing or partial); a different spec raises."""
    index = _read_index(cache_dir, spec)
    return FeatureCache(cache_dir, spec) if index is not None and index["complete"] else None


def _read_index(cache_dir: str, spec: dict[str, Any]) -> dict | None:
    path = os.path.join(cache_dir, INDEX)
    if not os.path.isfile(path):
        return None
    with open(path, encoding="utf-8") as f:
        index = json.load(f)
    if index["spec"] != spec and not serves(index["spec"], spec):
        diff = sorted(k for k in set(spec) | set(index["spec"]) if spec.get(k) != index["spec"].get(k))
        raise ValueError(f"feature cache {cache_dir!r} was built with a different spec (differs in {diff}: "
                         f"cached {[index['spec'].get(k) for k in diff]}, requested {[spec.get(k) for k in diff]}); "
                         "use another --feature-dir or delete it")
    return index


def serves(cached: dict[str, Any], wanted: dict[str, Any]) -> bool:
    """A cache also serves a run that needs less of it:
    - no aux layers (EAGLE-1, MTP) from a cache built with EAGLE-3's: the rest of each chunk (ids,
      masks, final hidden, argmax) does not depend on them;
    - a smaller --max-train-tokens: conversations come in a fixed order and a budget takes a prefix
      of them (training_conversations), so the smaller run reads that prefix (FeatureCache)."""
    if wanted.get("aux_layer_ids") and wanted.get("aux_layer_ids") != cached.get("aux_layer_ids"):
        return False
    have, want = cached.get("max_train_tokens"), wanted.get("max_train_tokens")
    if have is not None and (want is None or want > have):
        return False
    rest = lambda d: {k: v for k, v in d.items() if k not in ("aux_layer_ids", "max_train_tokens")}  # noqa: E731
    return rest(cached) == rest(wanted)


def _write_index(cache_dir: str, index: dict) -> None:
    tmp = os.path.join(cache_dir, INDEX + ".tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(index, f)
    os.replace(tmp, os.path.join(cache_dir, INDEX))


@dataclass
class FeatureCache:
    cache_dir: str
    spec: dict[str, Any]

    def __post_init__(self):
        index = _read_index(self.cache_dir, self.spec)
        if index is None or not index["complete"]:
            raise ValueError(f"feature cache {self.cache_dir!r} is missing or incomplete")
        self.chunks: list[dict] = index["chunks"]
        budget = self.spec.get("max_train_tokens")
        if budget is not None and budget < (index["spec"].get("max_train_tokens") or float("inf")):
            self.chunks = _prefix(self.chunks, budget)

    @property
    def num_tokens(self) -> int:
        return sum(sum(c["seq_lens"]) for c in self.chunks)

    @property
    def conversation_ids(self) -> list[str]:
        return [i for c in self.chunks for i in c["ids"]]

    def load(self, chunk: int, names: tuple[str, ...] | None = None) -> dict[str, torch.Tensor]:
        with safe_open(os.path.join(self.cache_dir, self.chunks[chunk]["file"]), framework="pt") as f:
            return {name: f.get_tensor(name) for name in (names or f.keys())}

    def token_counts(self, vocab_size: int) -> torch.Tensor:
        """[vocab] int64: how often each token is a training target (loss_mask 1) in the cache."""
        counts = torch.zeros(vocab_size, dtype=torch.int64)
        for i, chunk in enumerate(self.chunks):
            t = self.load(i, ("input_ids", "loss_mask"))
            n = sum(chunk["seq_lens"])  # a budget's last chunk may be cut short
            counts += torch.bincount(t["input_ids"][:n][t["loss_mask"][:n].bool()].long(), minlength=vocab_size)
        return counts


def _prefix(chunks: list[dict], budget: int) -> list[dict]:
    """The chunks (the last one cut) holding the conversations a run with this token budget trains on:
    as training_conversations, take the next conversation while fewer than `budget` tokens are in."""
    out, total = [], 0
    for chunk in chunks:
        keep = 0
        while keep < len(chunk["seq_lens"]) and total < budget:
            total += chunk["seq_lens"][keep]
            keep += 1
        if keep:
            out.append({**chunk, "ids": chunk["ids"][:keep], "seq_lens": chunk["seq_lens"][:keep]})
        if total >= budget:
            break
    return out
