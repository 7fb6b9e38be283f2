"""Sampling with speculation keeps the target distribution exactly (chi-square over 20k engine runs).

A small-vocab (V=8) random target and a random EAGLE draft: for each request the first token comes
from prefill, the next two from verify rounds. The empirical joint distribution of (t2, t3) must
match the exact target distribution computed from the model's processed next-token distributions.
"""
import dataclasses

import pytest
import torch

from specpd.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig, SpecConfig
from specpd.core import SamplingParams
from specpd.spec.draft.loader import random_draft_checkpoint
from specpd.engine.llm_engine import LLMEngine
from specpd.spec.cost import CostModel
from specpd.model.loader import load_checkpoint
from specpd.model.sampler import SamplingRow, process_logits
from tests.model.hf_models import save_tiny_model

VOCAB = 8
PROMPT = [1, 2, 3]


@pytest.fixture(scope="module")
def small_vocab(tmp_path_factory):
    target = tmp_path_factory.mktemp("v8")
    model = save_tiny_model("llama", target, seed=3, vocab_size=VOCAB)
    draft = tmp_path_factory.mktemp("v8draft")
    random_draft_checkpoint(str(draft), "eagle", ModelConfig.from_hf(load_checkpoint(str(target)).hf_config), seed=4)
    return str(target), str(draft), model


def exact_pair_distribution(model, params: SamplingParams) -> torch.Tensor:
    """P(t2, t3) [V, V] = sum_t1 p(t1) p(t2 | t1) p(t3 | t1, t2) under the processed distributions."""
    def dist(prefixes: list[list[int]]) -> torch.Tensor:
        with torch.no_grad():
            logits = model(torch.tensor(prefixes)).logits[:, -1].float()
        rows = [SamplingRow(params, PROMPT, p[len(PROMPT):], None) for p in prefixes]
        return process_logits(logits, rows)

    p1 = dist([PROMPT])[0]  # [V]
    p2 = dist([PROMPT + [a] for a in range(VOCAB)])  # [V(t1), V(t2)]
    p3 = dist([PROMPT + [a, b] for a in range(VOCAB) for b in range(VOCAB)]).view(VOCAB, VOCAB, VOCAB)
    return torch.einsum("a,ab,abc->bc", p1, p2, p3)


def sample_pairs(target, draft, spec: SpecConfig, params: SamplingParams, n: int) -> torch.Tensor:
    engine = LLMEngine(EngineConfig(model=target, cache=CacheConfig(page_size=4, num_pages=4 * 1024),
                                    scheduler=SchedulerConfig(max_num_batched_tokens=1 << 14,
                                                              max_running_requests=1024), spec=spec))
    if engine.spec_runner.policy is not None:
        # a request costs 1, an extra row 0.45 of it, the engine-wide prior stays 0.5: the first round
        # speculates, the second only if the first accepted (estimate 0.6, not 0.4): depth follows luck
        engine.spec_runner.policy.cost = CostModel({1: 0.45, 64: 0.45 * 64}, 0.55, {1: 1e-4, 64: 2e-4}, frozen=True)
        engine.spec_runner.policy.frozen = True
    counts = torch.zeros(VOCAB, VOCAB)
    verified = 0
    for base in range(0, n, 1024):
        outs = engine.generate([PROMPT] * min(1024, n - base), params)
        for o in outs:
            counts[o.token_ids[1], o.token_ids[2]] += 1
            verified += o.spec_verify_count
    assert engine.free_pages == 4 * 1024
    # every request went through at least one verify (fixed depth); adaptive / n-gram rounds may be plain
    assert verified >= (n if spec.spec_adaptive is False and not spec.model_free else n // 4), verified
    return counts


def chi_square_p(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Goodness of fit; cells with expected count < 5 are pooled into one."""
    n = counts.sum()
    expected = (probs * n).flatten()
    obs = counts.flatten()
    small = expected < 5
    exp_cells = torch.cat([expected[~small], expected[small].sum().view(1)])
    obs_cells = torch.cat([obs[~small], obs[small].sum().view(1)])
    keep = exp_cells > 0
    if bool(((obs_cells > 0) & ~keep).any()):
        return 0.0  # mass where the target has none
    stat = float(((obs_cells[keep] - exp_cells[keep]) ** 2 / exp_cells[keep]).sum())
    dof = int(keep.sum()) - 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2.0), torch.tensor(stat / 2.0)))


CASES = [
    ("chain, temperature 1", SpecConfig("eagle", spec_num_steps=2, spec_adaptive=False), dict(temperature=1.0)),
    ("tree, top_p 0.8", SpecConfig("eagle", spec_num_steps=2, spec_topk=2, spec_num_draft_tokens=5,
                                   spec_adaptive=False), dict(temperature=0.9, top_p=0.8)),
    # n-gram proposals (mostly from the shared store of earlier requests' outputs), a tree of them
    ("ngram tree, temperature 1", SpecConfig("ngram", spec_num_steps=2, spec_topk=2, spec_num_draft_tokens=5,
                                             spec_ngram_min_match=1, spec_adaptive=False), dict(temperature=1.0)),
    # adaptive depth: some rounds plain decode, some speculate, per request
    ("adaptive chain, temperature 1", SpecConfig("eagle", spec_num_steps=2), dict(temperature=1.0)),
]


@pytest.mark.parametrize("name,spec,sampling", CASES, ids=[c[0] for c in CASES])
def test_spec_sampling_follows_target(small_vocab, name, spec, sampling):
    target, draft, model = small_vocab
    params = SamplingParams(max_tokens=3, ignore_eos=True, **sampling)
    if not spec.model_free:
        spec = dataclasses.replace(spec, draft_model=draft)
    counts = sample_pairs(target, draft, spec, params, 14000)  # a broken verifier fails at 4000 (below)
    assert chi_square_p(counts, exact_pair_distribution(model, params)) > 0.01


def test_broken_verifier_fails_the_same_test(small_vocab, monkeypatch):
    """Accepting every proposed token skews the output toward the draft: the test must catch it."""
    import specpd.spec.verify.rejection as rejection
    monkeypatch.setattr(rejection, "_accept", lambda coin, r_tok, q_tok: torch.ones_like(coin, dtype=torch.bool))
    target, draft, model = small_vocab
    params = SamplingParams(max_tokens=3, ignore_eos=True, temperature=1.0)
    spec = SpecConfig("eagle", draft_model=draft, spec_num_steps=2, spec_adaptive=False)
    counts = sample_pairs(target, draft, spec, params, 4000)
    assert chi_square_p(counts, exact_pair_distribution(model, params)) < 1e-6
