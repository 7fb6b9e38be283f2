"""Sampler: masks are exact on hand-made distributions and draws follow the processed distribution."""
import math

import pytest
import torch

from specpd.core import SamplingParams
from specpd.model.sampler import SamplingRow, apply_penalties, greedy_tokens, process_logits, sample

LOGITS = torch.log(torch.tensor([[0.4, 0.25, 0.15, 0.1, 0.06, 0.04]]))


def row(prompt=(), output=(), gen=None, suppress=(), **kw):
    return SamplingRow(SamplingParams(**kw), list(prompt), list(output), gen, tuple(suppress))


def probs_for(**kw):
    return process_logits(LOGITS.clone(), [row(**kw)])[0]


def test_temperature_one_keeps_distribution():
    assert torch.allclose(probs_for(temperature=1.0), LOGITS.exp()[0], atol=1e-6)


def test_top_k_top_p_min_p_masks():
    base = LOGITS.exp()[0]
    assert torch.allclose(probs_for(top_k=2), torch.cat([base[:2] / base[:2].sum(), torch.zeros(4)]), atol=1e-6)
    # top_p=0.6: 0.4 + 0.25 is the smallest prefix reaching 0.6
    assert torch.allclose(probs_for(top_p=0.6), torch.cat([base[:2] / 0.65, torch.zeros(4)]), atol=1e-6)
    # min_p=0.3: keep p >= 0.3 * 0.4 = 0.12
    assert torch.allclose(probs_for(min_p=0.3), torch.cat([base[:3] / 0.8, torch.zeros(3)]), atol=1e-6)


def test_greedy_is_one_hot():
    p = probs_for(temperature=0.0)
    assert p.tolist() == [1.0, 0, 0, 0, 0, 0]


def test_penalties():
    logits = torch.tensor([[2.0, -2.0, 1.0, 0.5]])
    out = apply_penalties(logits.clone(), [row(prompt=[0], output=[1], repetition_penalty=2.0)])
    assert out.tolist() == [[1.0, -4.0, 1.0, 0.5]]
    out = apply_penalties(logits.clone(), [row(output=[2, 2, 3], frequency_penalty=0.5, presence_penalty=0.25)])
    assert out.tolist() == [[2.0, -2.0, 1.0 - 1.0 - 0.25, 0.5 - 0.5 - 0.25]]
    out = apply_penalties(logits.clone(), [row(suppress=[0])])
    assert out[0, 0] == float("-inf")


@pytest.mark.parametrize("kw", [dict(temperature=1.0), dict(temperature=0.7, top_p=0.8), dict(top_k=3)])
def test_draws_follow_processed_distribution(kw):
    """Chi-square goodness of fit over 20k draws (p > 0.001 threshold at 5 dof ~ 20.5)."""
    rows = [row(**kw)]
    target = process_logits(LOGITS.clone(), rows)[0]
    gen = torch.Generator().manual_seed(0)
    n = 20000
    counts = torch.zeros(6)
    for _ in range(n):
        counts[sample(target.unsqueeze(0), rows, gen)[0]] += 1
    support = target > 0
    assert counts[~support].sum() == 0
    expected = target[support] * n
    chi2 = float(((counts[support] - expected) ** 2 / expected).sum())
    dof = int(support.sum()) - 1
    assert chi2 < {1: 10.8, 2: 13.8, 3: 16.3, 4: 18.5, 5: 20.5}[dof]


def test_broken_sampler_fails_the_fit():
    """The same statistic rejects draws from a wrong distribution (so the test above can fail)."""
    target = LOGITS.exp()[0]
    wrong = torch.softmax(LOGITS[0] / 0.8, dim=-1)
    gen = torch.Generator().manual_seed(0)
    n = 20000
    draws = torch.multinomial(wrong, n, replacement=True, generator=gen)
    counts = torch.bincount(draws, minlength=6).float()
    chi2 = float(((counts - target * n) ** 2 / (target * n)).sum())
    assert chi2 > 20.5


def test_seeded_generator_reproducible():
    rows = [row(temperature=1.0, gen=torch.Generator().manual_seed(7))]
    p = process_logits(LOGITS.clone(), rows)
    a = [sample(p, rows, None)[0] for _ in range(20)]
    rows = [row(temperature=1.0, gen=torch.Generator().manual_seed(7))]
    b = [sample(p, rows, None)[0] for _ in range(20)]
    assert a == b and not math.isnan(p.sum())


@pytest.mark.parametrize("threads", [1, 2])
def test_greedy_tokens_is_argmax_with_ties_and_nan(threads):
    """The greedy fast path reads max(dim).indices: the first maximum, exactly argmax's, on rows full of ties
    (small integers, bf16-rounded), of lengths across the vector lanes, with NaN, at 1 and 2 threads."""
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        g = torch.Generator().manual_seed(0)
        for n in (1, 7, 16, 33, 1000, 49152):
            x = torch.randint(-3, 4, (5, n), generator=g).float()
            assert torch.equal(greedy_tokens(x), x.argmax(dim=-1))
            y = torch.randn(5, n, generator=g).bfloat16().float()
            assert torch.equal(greedy_tokens(y), y.argmax(dim=-1))
        z = torch.tensor([[1.0, float("nan"), 3.0, float("nan")], [2.0, 5.0, 5.0, -1.0]])
        assert greedy_tokens(z).tolist() == z.argmax(dim=-1).tolist() == [1, 1]
    finally:
        torch.set_num_threads(old)
