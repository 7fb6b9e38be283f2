"""Per-request sampling: penalties, temperature, top-k / top-p / min-p, seeded draws, logprobs.

`process_logits` turns raw logits into the distribution a request samples from (speculative verify
reuses it to get the target distribution p); `sample` draws from it.
Logprobs reported to clients are those of the raw model distribution (before penalties/temperature),
as vLLM does by default.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from specpd.core import SamplingParams, TokenLogprob


@dataclass
class SamplingRow:
    """Everything the sampler needs for one row of logits (built by the model runner)."""

    params: SamplingParams
    prompt_ids: list[int]
    output_ids: list[int]
    generator: torch.Generator | None  # per-request, seeded; None -> the runner's shared generator
    suppress_ids: tuple[int, ...] = ()  # EOS / stop ids while min_tokens is not reached


def apply_penalties(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    for i, row in enumerate(rows):
        p = row.params
        if row.suppress_ids:
            logits[i, list(row.suppress_ids)] = float("-inf")
        if not p.needs_penalties:
            continue
        vocab = logits.shape[1]
        if p.repetition_penalty != 1.0:
            seen = torch.tensor(sorted(set(row.prompt_ids) | set(row.output_ids)), dtype=torch.long)
            seen = seen[seen < vocab]
            vals = logits[i, seen]
            logits[i, seen] = torch.where(vals > 0, vals / p.repetition_penalty, vals * p.repetition_penalty)
        if row.output_ids and (p.frequency_penalty or p.presence_penalty):
            counts = torch.bincount(torch.tensor(row.output_ids), minlength=vocab)[:vocab].to(logits.dtype)
            logits[i] -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(logits.dtype)
    return logits


def process_logits(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """logits [n, vocab] (fp32, modified in place) -> probabilities [n, vocab] each row samples from.
    Greedy rows get a one-hot on the argmax."""
    logits = apply_penalties(logits, rows)
    probs = torch.empty_like(logits)
    for i, row in enumerate(rows):
        p = row.params
        if p.greedy:
            probs[i].zero_()
            probs[i, logits[i].argmax()] = 1.0
            continue
        x = logits[i] / p.temperature
        if 0 < p.top_k < x.shape[0]:
            kth = torch.topk(x, p.top_k).values[-1]
            x = x.masked_fill(x < kth, float("-inf"))
        pr = torch.softmax(x, dim=-1)
        if p.top_p < 1.0:
            sorted_p, order = pr.sort(descending=True)
            cum = sorted_p.cumsum(0)
            drop_sorted = (cum - sorted_p) >= p.top_p  # keep the smallest prefix reaching top_p
            pr = pr.scatter(0, order, sorted_p.masked_fill(drop_sorted, 0.0))
        if p.min_p > 0.0:
            pr = pr.masked_fill(pr < p.min_p * pr.max(), 0.0)
        probs[i] = pr / pr.sum()
    return probs


def sample(probs: torch.Tensor, rows: list[SamplingRow], shared: torch.Generator) -> list[int]:
    """One draw per row (exponential race: argmax p / E with E ~ Exp(1), exact for categorical)."""
    out = []
    for i, row in enumerate(rows):
        if row.params.greedy:
            out.append(int(probs[i].argmax()))
            continue
        e = torch.empty_like(probs[i]).exponential_(generator=row.generator or shared)
        out.append(int((probs[i] / e).argmax()))
    return out


def greedy_tokens(logits: torch.Tensor) -> torch.Tensor:
    """[..., vocab] -> [...] long: the index of each row's first maximum, exactly `argmax(dim=-1)` (ties and NaN
    alike; tests/model/test_sampler.py), read off `max(dim=-1)`, which is 2.5x faster on CPU: at batch 32 the greedy
    argmax over the vocabulary cost 1 ms of a round (2 threads)."""
    return logits.max(dim=-1).indices


def greedy_fast_path(rows: list[SamplingRow]) -> bool:
    return all(r.params.greedy and not r.params.needs_penalties and not r.suppress_ids for r in rows)


def compute_logprobs(logits: torch.Tensor, token_ids: list[int], rows: list[SamplingRow]) -> list[TokenLogprob | None]:
    """Raw-distribution logprob of the chosen token plus top-n, for rows that asked."""
    wanted = [i for i, r in enumerate(rows) if r.params.logprobs is not None]
    result: list[TokenLogprob | None] = [None] * len(rows)
    if not wanted:
        return result
    lp = torch.log_softmax(logits[wanted], dim=-1)
    for j, i in enumerate(wanted):
        n = rows[i].params.logprobs
        top = []
        if n:
            vals, ids = lp[j].topk(n)
            top = list(zip(ids.tolist(), vals.tolist()))
        result[i] = TokenLogprob(token_ids[i], float(lp[j, token_ids[i]]), top)
    return result
