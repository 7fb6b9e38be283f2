"""Speculative constrained sampling is exact: on a 5-token vocabulary and a tiny regex, verify against the
target masked at each tree node commits tokens with the non-speculative constrained distribution (chi^2),
while verifying against the unmasked target does not.

The tree proposes grammar-refused tokens on purpose (the target likes them): root -> [c, a, ab],
a -> [ab, b]; 'c' is refused at the root, 'ab' after 'a'.
"""
import pytest
import torch
import xgrammar as xgr

from specpd.core import SamplingParams
from specpd.grammar.matcher import GrammarStats, RequestGrammar, mask_tree_logits
from specpd.model.sampler import SamplingRow, process_logits
from specpd.spec.verify.rejection import verify_trees
from specpd.spec.tree import DraftTree

VOCAB = ["a", "b", "c", "ab", "</s>"]
A, B, C, AB, EOS = range(5)
REGEX = "(a|b)(a|b)c?"
TOKENS = torch.tensor([0, C, A, AB, AB, B])
PARENTS = torch.tensor([-1, 0, 0, 0, 2, 2])
LOGITS = torch.tensor([[0.5, 0.0, 2.0, 0.3, 1.0],  # root: 'c' and EOS refused
                       [0.0, 0.0, 0.0, 0.0, 0.0],  # after 'c': never reached when masked
                       [0.2, 1.0, 0.0, 1.5, 0.0],  # after 'a': 'ab', 'c' and EOS refused
                       [0.1, 0.2, 0.9, 0.0, 0.4],  # after 'ab': only 'c' or EOS
                       [0.0, 0.0, 0.0, 0.0, 0.0],
                       [0.3, 0.1, 0.7, 0.2, 0.5]])
ROUNDS = 6000


def grammar() -> RequestGrammar:
    info = xgr.TokenizerInfo(VOCAB, xgr.VocabType.RAW, vocab_size=len(VOCAB), stop_token_ids=[EOS])
    compiled = xgr.GrammarCompiler(info, max_threads=1).compile_regex(REGEX)
    return RequestGrammar(xgr.GrammarMatcher(compiled), len(VOCAB), GrammarStats())


def outcome(committed: list[int]) -> tuple[int, ...]:
    """The first token, and the second when the first was 'a' (the round then always has one)."""
    return tuple(committed[:2]) if committed[0] == A else (committed[0],)


def expected() -> dict[tuple[int, ...], float]:
    root = torch.softmax(LOGITS[0].masked_fill(torch.tensor([0, 0, 1, 0, 1], dtype=torch.bool), -torch.inf), 0)
    after_a = torch.softmax(LOGITS[2].masked_fill(torch.tensor([0, 0, 1, 1, 1], dtype=torch.bool), -torch.inf), 0)
    return {(B,): float(root[B]), (AB,): float(root[AB]), (A, A): float(root[A] * after_a[A]),
            (A, B): float(root[A] * after_a[B])}


def spec_rounds(masked: bool) -> dict[tuple[int, ...], int]:
    logits = LOGITS.clone()
    if masked:
        mask_tree_logits(logits, grammar(), TOKENS, PARENTS)
    rows = [SamplingRow(SamplingParams(temperature=1.0), [0], [], None)] * len(TOKENS)
    probs = process_logits(logits, rows)
    tree = DraftTree(TOKENS, PARENTS, torch.tensor([0, 1, 1, 1, 2, 2]), torch.zeros(len(TOKENS)))
    results = verify_trees([tree] * ROUNDS, probs.repeat(ROUNDS, 1),
                           shared_generator=torch.Generator().manual_seed(1234))
    counts: dict[tuple[int, ...], int] = {}
    for r in results:
        key = outcome(r.committed_tokens)
        counts[key] = counts.get(key, 0) + 1
    return counts


def chi2_pvalue(counts: dict, probs: dict) -> float:
    if set(counts) - set(probs):  # an outcome the grammar forbids
        return 0.0
    stat = sum((counts.get(k, 0) - ROUNDS * p) ** 2 / (ROUNDS * p) for k, p in probs.items())
    df = len(probs) - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2), torch.tensor(stat / 2)))


def test_tree_verify_against_the_masked_target_is_exact():
    assert chi2_pvalue(spec_rounds(masked=True), expected()) > 1e-3


def test_verify_against_the_unmasked_target_fails():
    counts = spec_rounds(masked=False)
    assert counts.get((C,), 0) > ROUNDS // 4  # the refused 'c' is committed
    assert chi2_pvalue(counts, expected()) < 1e-9


@pytest.mark.parametrize("first,allowed", [(A, {A, B}), (AB, {C, EOS})])
def test_tree_mask_rows_are_the_grammar_state_at_each_node(first, allowed):
    logits = torch.zeros(len(TOKENS), len(VOCAB))
    mask_tree_logits(logits, grammar(), TOKENS, PARENTS)
    node = 2 if first == A else 3
    assert set(torch.isfinite(logits[node]).nonzero().flatten().tolist()) == allowed
    assert set(torch.isfinite(logits[0]).nonzero().flatten().tolist()) == {A, B, AB}
