"""The n-gram drafter under a grammar: candidates the grammar refuses along the draft path never enter the tree,
a lower-ranked allowed candidate takes their slot, and the matcher is left where it was."""
import xgrammar as xgr

from specpd.core import Request, SamplingParams
from specpd.spec.draft.ngram import NgramProposer
from specpd.grammar.matcher import GrammarStats, RequestGrammar

VOCAB = ["a", "b", "c", "ab", "</s>"]
A, B, C, AB, EOS = range(5)


def grammar(regex: str) -> RequestGrammar:
    info = xgr.TokenizerInfo(VOCAB, xgr.VocabType.RAW, vocab_size=len(VOCAB), stop_token_ids=[EOS])
    return RequestGrammar(xgr.GrammarMatcher(xgr.GrammarCompiler(info, max_threads=1).compile_regex(regex)),
                          len(VOCAB), GrammarStats())


def tree(req: Request, topk: int):
    return NgramProposer(num_steps=3, topk=topk, num_draft_tokens=8, min_match=1, max_match=2).tree_for(req, 3, 8)


def paths(t) -> list[list[int]]:
    """Each node's tokens after the root."""
    out: list[list[int]] = []
    for tok, par in zip(t.tokens.tolist(), t.parents.tolist()):
        out.append([] if par < 0 else out[par] + [tok])
    return out


# after "b a" the history says "c" twice, then "b" once
HISTORY = [B, A, C, B, A, C, B, A, B, B, A]


def test_refused_candidates_never_enter_the_tree():
    free = tree(Request("free", HISTORY, SamplingParams()), topk=1)
    assert int(free.tokens[1]) == C  # the control: without a grammar the top count wins
    req = Request("json", HISTORY, SamplingParams())
    req.grammar = grammar("(a|b)+")  # 'c' is never allowed; EOS only after a letter
    t = tree(req, topk=1)
    assert t.tokens.numel() > 1 and int(t.tokens[1]) == B  # the lower-ranked allowed token took the slot
    for path in paths(t)[1:]:
        g = grammar("(a|b)+")
        assert all(g.accept(tok) for tok in path), path
    assert req.grammar.stats.mask_seconds > 0
    assert not req.grammar.accept(C) and req.grammar.accept(A)  # the walk left the matcher at the start


def test_a_path_the_grammar_ends_is_not_extended():
    req = Request("end", [A, B, EOS, A, B, EOS, A, B], SamplingParams())
    req.grammar = grammar("ab")
    assert req.grammar.accept(A) and req.grammar.accept(B)  # committed "ab": only EOS may follow
    t = tree(req, topk=2)
    assert paths(t)[1:] == [[EOS]]  # EOS, and nothing after it (no warning from a terminated matcher)
