"""Per-request sampling: penalties, temperature, top-k / top-p / min-p, seeded draws, logprobs.

`process_logits` turns raw logits into the distribution a request samples from (speculative verify
reuses it to get the target distribution p); `sample` draws from it.
Logprobs reported to clients are those of the raw model distribution (before penalties/temperature),
as vLLM does by default.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

from specpd.core import RequestFaults, SamplingParams, TokenLogprob


@dataclass
class SamplingRow:
    """Everything the sampler needs for one row of logits (built by the model runner)."""

    params: SamplingParams
    prompt_ids: list[int]
    output_ids: list[int]
    generator: torch.Generator | None  # per-request, seeded; None -> the runner's shared generator
    suppress_ids: tuple[int, ...] = ()  # EOS / stop ids while min_tokens is not reached
    request_id: str = ""  # whose row: a failure of this row fails that request only (RequestFaults)


def _guard(faults: RequestFaults | None, row: SamplingRow, what: str):
    """Row work that one request's parameters drive: with `faults`, a failure fails that request and the batch goes
    on (the row keeps the value its caller put in place first); without, it raises."""
    return faults.guard(row.request_id, what) if faults is not None else contextlib.nullcontext()


def apply_penalties(logits: torch.Tensor, rows: list[SamplingRow], faults: RequestFaults | None = None
                    ) -> torch.Tensor:
    """A row's logit bias, then its min_tokens suppression, then its penalties (vLLM's order), in place."""
    for i, row in enumerate(rows):
        with _guard(faults, row, "sampling (logit bias and penalties)"):
            _penalize(logits, i, row)
    return logits


def _penalize(logits: torch.Tensor, i: int, row: SamplingRow) -> None:
    p = row.params
    if p.logit_bias:
        ids, bias = zip(*p.logit_bias)
        logits[i, list(ids)] += torch.tensor(bias, dtype=logits.dtype)
    if row.suppress_ids:
        logits[i, list(row.suppress_ids)] = float("-inf")
    if not p.needs_penalties:
        return
    vocab = logits.shape[1]
    if p.repetition_penalty != 1.0:
        seen = torch.tensor(sorted(set(row.prompt_ids) | set(row.output_ids)), dtype=torch.long)
        seen = seen[seen < vocab]
        vals = logits[i, seen]
        logits[i, seen] = torch.where(vals > 0, vals / p.repetition_penalty, vals * p.repetition_penalty)
    if row.output_ids and (p.frequency_penalty or p.presence_penalty):
        counts = torch.bincount(torch.tensor(row.output_ids), minlength=vocab)[:vocab].to(logits.dtype)
        logits[i] -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(logits.dtype)


def process_logits(logits: torch.Tensor, rows: list[SamplingRow], faults: RequestFaults | None = None
                   ) -> torch.Tensor:
    """logits [n, vocab] (fp32, modified in place) -> probabilities [n, vocab] each row samples from.
    Greedy rows get a one-hot on the argmax; so does a row that failed (`faults`: its request is finished)."""
    logits = apply_penalties(logits, rows, faults)
    probs = torch.zeros_like(logits)
    probs[torch.arange(len(rows)), logits.argmax(dim=-1)] = 1.0
    for i, row in enumerate(rows):
        if not row.params.greedy:
            with _guard(faults, row, "sampling"):
                probs[i] = _distribution(logits[i], row.params)
    return probs


def _distribution(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    x = logits / p.temperature
    if 0 < p.top_k < x.shape[0]:
        kth = torch.topk(x, p.top_k).values[-1]
        x = x.masked_fill(x < kth, float("-inf"))
    pr = torch.softmax(x, dim=-1)
    if p.top_p < 1.0:
        sorted_p, order = pr.sort(descending=True)
        cum = sorted_p.cumsum(0)
        drop_sorted = (cum - sorted_p) >= p.top_p  # keep the smallest prefix reaching top_p
        drop_sorted[0] = False  # always the top token: a top_p below float32's range compares as 0
        pr = pr.scatter(0, order, sorted_p.masked_fill(drop_sorted, 0.0))
    if p.min_p > 0.0:
        pr = pr.masked_fill(pr < p.min_p * pr.max(), 0.0)
    total = pr.sum()
    if not torch.isfinite(total) or total <= 0:  # e.g. a penalty that sent logits to +inf
        raise ValueError(f"the sampling parameters leave no valid distribution (temperature {p.temperature}, "
                         f"repetition_penalty {p.repetition_penalty})")
    return pr / total


def sample(probs: torch.Tensor, rows: list[SamplingRow], shared: torch.Generator,
           faults: RequestFaults | None = None) -> list[int]:
    """One draw per row (exponential race: argmax p / E with E ~ Exp(1), exact for categorical)."""
    out = [int(t) for t in probs.argmax(dim=-1).tolist()]
    for i, row in enumerate(rows):
        if not row.params.greedy:
            with _guard(faults, row, "sampling"):
                e = torch.empty_like(probs[i]).exponential_(generator=row.generator or shared)
                out[i] = int((probs[i] / e).argmax())
    return out


def greedy_tokens(logits: torch.Tensor) -> torch.Tensor:
    """[..., vocab] -> [...] long: the index of each row's first maximum, exactly `argmax(dim=-1)` (ties and NaN
    alike; tests/model/test_sampler.py), read off `max(dim=-1)`, which torch runs faster on CPU than `argmax`: at
    batch 32 the greedy argmax over the vocabulary is a visible share of a round."""
    return logits.max(dim=-1).indices


def greedy_fast_path(rows: list[SamplingRow]) -> bool:
    return all(r.params.greedy and not r.params.adjusts_logits and not r.suppress_ids for r in rows)


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
