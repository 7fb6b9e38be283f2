"""N-gram drafting: incremental suffix counts, the bounded shared store, best-first trees, hybrid merge,
and lossless greedy decoding with ngram / hybrid proposals on tiny targets and SmolLM2."""
import random

import pytest
import torch

from specpd.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig, SpecConfig
from specpd.core import Request, SamplingParams
from specpd.spec.draft.hybrid import merge_trees, union_trie
from specpd.spec.draft.loader import random_draft_checkpoint
from specpd.spec.draft.ngram import NgramProposer, NgramStore, SuffixCounts
from specpd.engine.llm_engine import LLMEngine
from specpd.model.loader import load_checkpoint
from specpd.spec.tree import DraftTree
from tests.model.hf_models import save_tiny_model

NUM_PAGES = 256


def rescan(tokens: list[int], max_match: int) -> dict:
    table: dict = {}
    for i in range(1, len(tokens)):
        for n in range(1, min(max_match, i) + 1):
            counts = table.setdefault(tuple(tokens[i - n:i]), {})
            counts[tokens[i]] = counts.get(tokens[i], 0) + 1
    return table


def test_suffix_counts_incremental_equals_rescan():
    rng = random.Random(0)
    tokens = [rng.randrange(6) for _ in range(300)]
    counts = SuffixCounts(max_match=5)
    done = 0
    for cut in (1, 2, 17, 18, 150, 300):  # appended in uneven pieces, as commits arrive
        counts.add(tokens[:cut], start=max(1, done))
        done = cut
    assert {k: dict(v) for k, v in counts.table.items()} == rescan(tokens, 5)


def test_lookup_takes_the_longest_seen_context_and_ranks_by_count_then_recency():
    counts = SuffixCounts(max_match=4)
    counts.add([1, 2, 3, 9, 1, 2, 3, 7, 5, 2, 3, 8, 5, 2, 3, 8])
    n, nxt = counts.lookup([4, 5, 2, 3], min_match=2)
    assert n == 3 and nxt == {8: 2}  # "5 2 3" was followed by 8 twice; "4 5 2 3" never seen
    n, nxt = counts.lookup([1, 2, 3], min_match=2)
    assert n == 3 and nxt == {9: 1, 7: 1}
    assert counts.lookup([6, 6], min_match=2) == (0, None)
    proposer = NgramProposer(num_steps=1, topk=3, num_draft_tokens=4, min_match=2, max_match=4)
    req = Request("r", [1, 2, 3, 9, 1, 2, 3, 7, 1, 2], SamplingParams())
    proposer._sync(req)
    assert [t for t, _ in proposer.candidates(req, [1, 2, 3])] == [7, 9]  # equal counts: the most recent first


def test_store_is_bounded_and_forgets_exactly():
    store = NgramStore(max_tokens=50, max_match=3)
    rng = random.Random(1)
    for i in range(20):
        store.add([100 + i] * 4, [rng.randrange(5) for _ in range(rng.randrange(1, 30))])
        assert store.num_tokens <= 50
    kept = list(store._sequences)
    want: dict = {}
    for seq, first in kept:  # what the kept sequences alone would give
        sub = SuffixCounts(3)
        sub.add(seq, start=first)
        for k, v in sub.table.items():
            for t, c in v.items():
                want.setdefault(k, {})[t] = want.setdefault(k, {}).get(t, 0) + c
    assert {k: dict(v) for k, v in store.counts.table.items()} == want
    while store._sequences:
        seq, first = store._sequences.popleft()
        store.counts.add(seq, start=first, delta=-1)
    assert len(store.counts) == 0  # nothing left behind: the bound is the whole story


def test_trees_are_best_first_within_budget_and_ancestor_closed():
    prompt = [1, 2, 3, 4, 5, 1, 2, 3, 4, 6, 1, 2, 3, 4, 5, 1, 2, 3]
    proposer = NgramProposer(num_steps=4, topk=2, num_draft_tokens=6, min_match=1, max_match=4, store_tokens=0)
    req = Request("r", prompt, SamplingParams())
    tree = proposer.tree_for(req, 4, 6)
    # estimates count / (total + 1): "5 1 2 3" -> 4 (1/2); "1 2 3 4" -> 5 (2/4), 6 (1/4); "2 3 4 5" -> 1 (2/3);
    # "3 4 5 1" -> 2 (2/3). Path scores: 4 .5, 5 .25, 1 .167, 6 .125, 2 .111
    assert tree.tokens.tolist() == [3, 4, 5, 1, 6, 2]
    assert tree.parents.tolist() == [-1, 0, 1, 2, 1, 3]
    parents = tree.parents.tolist()
    assert all(parents[i] < i for i in range(1, tree.num_nodes))
    assert all(float(tree.cum_logprob[i]) <= float(tree.cum_logprob[parents[i]]) + 1e-6
               for i in range(1, tree.num_nodes))
    chain = NgramProposer(num_steps=4, topk=1, num_draft_tokens=5, min_match=2, max_match=4, store_tokens=0)
    t = chain.tree_for(Request("c", prompt, SamplingParams()), 4, 5)
    assert t.tokens.tolist() == [3, 4, 5, 1, 2]  # copies the most recent continuation
    assert chain.tree_for(Request("n", [7, 8, 9], SamplingParams()), 4, 5).num_nodes == 1  # no match: decode


def test_shared_store_proposes_across_requests():
    proposer = NgramProposer(num_steps=3, topk=1, num_draft_tokens=4, min_match=2, max_match=4)
    done = Request("a", [50, 51], SamplingParams())
    done.output_token_ids = [60, 61, 62, 63, 64]
    proposer._sync(done)
    proposer.release(done)  # its output enters the store
    tree = proposer.tree_for(Request("b", [9, 60, 61], SamplingParams()), 3, 4)
    assert tree.tokens.tolist() == [61, 62, 63, 64]


def test_merge_trees_unions_paths_and_keeps_the_likeliest():
    a = DraftTree(torch.tensor([0, 5, 6, 7]), torch.tensor([-1, 0, 1, 0]), torch.tensor([0, 1, 2, 1]),
                  torch.tensor([0.0, 0.5, 0.25, 0.1]).log())
    b = DraftTree(torch.tensor([0, 5, 8]), torch.tensor([-1, 0, 1]), torch.tensor([0, 1, 2]),
                  torch.tensor([0.0, 0.5, 0.45]).log())
    merged = merge_trees([a, b], budget=4)
    assert merged.tokens.tolist() == [0, 5, 6, 8]  # 5 (both: 0.75), 8 (0.45), 6 (0.25); 7 (0.1) dropped
    assert merged.parents.tolist() == [-1, 0, 1, 1]
    assert merged.depth.tolist() == [0, 1, 2, 2]
    assert merged.cum_logprob.exp()[1].item() == pytest.approx(0.75)


def torch_merge_trees(trees: list[DraftTree], budget: int) -> DraftTree:
    """merge_trees as it was, ranking with torch ops: its reference (the union itself is the same code)."""
    tokens, parents, depth, miss = union_trie(trees)
    score = torch.tensor([1.0 - x for x in miss])
    score[0] = 2.0
    keep = torch.sort(score, descending=True, stable=True).indices[:budget].sort().values
    new_id = torch.full((len(tokens),), -1, dtype=torch.long)
    new_id[keep] = torch.arange(keep.numel())
    par = torch.tensor(parents)[keep]
    return DraftTree(torch.tensor(tokens)[keep], torch.where(par < 0, -1, new_id[par.clamp(min=0)]),
                     torch.tensor(depth)[keep], score[keep].clamp(max=1.0).clamp(min=1e-12).log())


def test_merge_trees_equals_the_torch_ranking_it_replaced():
    """Ranked in Python, merged trees equal the torch version's (ties, shared paths, budgets past the trie)."""
    from tests.spec.tree_reference import random_tree
    gen = torch.Generator().manual_seed(0)
    for _ in range(60):
        a = random_tree(gen, int(torch.randint(1, 10, (1,), generator=gen)), vocab=3)
        b = random_tree(gen, int(torch.randint(1, 10, (1,), generator=gen)), vocab=3)
        for budget in (1, 2, 4, 6, 20):
            got, want = merge_trees([a, b], budget), torch_merge_trees([a, b], budget)
            for name in ("tokens", "parents", "depth", "cum_logprob"):
                x, y = getattr(got, name), getattr(want, name)
                assert x.dtype == y.dtype and torch.equal(x, y), name


def test_merge_trees_ranks_float32_scores_so_a_tie_keeps_the_earlier_node():
    """Two root children drafted by both trees, whose merged scores 1 - (1 - p_a)(1 - p_b) differ in double but
    round to one float32 value, tie, and the earlier one stays: the ranking the torch version made on its float32
    scores."""
    logp = torch.tensor(-1.2)  # path probabilities ~0.3
    p = logp.exp().item()
    while True:  # the later child's second source a float32 step up, until its score only differs in double
        logp = torch.nextafter(logp, torch.tensor(0.0))
        q = logp.exp().item()
        s5, s6 = 1 - (1 - p) * (1 - p), 1 - (1 - p) * (1 - q)
        if s6 > s5 and torch.tensor(s6).item() == torch.tensor(s5).item():
            break
    both = dict(parents=torch.tensor([-1, 0, 0]), depth=torch.tensor([0, 1, 1]))
    a = DraftTree(torch.tensor([0, 5, 6]), cum_logprob=torch.tensor([0.0, p, p]).log(), **both)
    b = DraftTree(torch.tensor([0, 5, 6]), cum_logprob=torch.stack([torch.tensor(0.0), torch.tensor(p).log(), logp]),
                  **both)
    assert torch_merge_trees([a, b], budget=2).tokens.tolist() == [0, 5]
    assert merge_trees([a, b], budget=2).tokens.tolist() == [0, 5]


# -- lossless in the engine -------------------------------------------------------------------
PROMPTS = [[5, 17, 99, 3, 5, 17, 99, 3, 5, 17], list(range(40, 77)) * 2, [7], list(range(100, 113)) + [100, 101]]
GREEDY = SamplingParams(max_tokens=25, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module", params=["llama", "qwen3"])
def tiny(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    save_tiny_model(request.param, path, num_hidden_layers=8)
    ref = LLMEngine(EngineConfig(model=str(path), cache=CacheConfig(page_size=4, num_pages=NUM_PAGES)))
    return str(path), [o.token_ids for o in ref.generate(PROMPTS, GREEDY)]


def run(path, spec, prompts, chunk=8):
    engine = LLMEngine(EngineConfig(model=path, cache=CacheConfig(page_size=4, num_pages=NUM_PAGES),
                                    scheduler=SchedulerConfig(chunked_prefill_size=chunk), spec=spec))
    outs = engine.generate(prompts, GREEDY)
    assert engine.free_pages == NUM_PAGES
    return outs, engine


@pytest.mark.parametrize("adaptive", [False, True])
@pytest.mark.parametrize("topk,tokens", [(1, None), (2, 6)])
def test_ngram_is_lossless(tiny, adaptive, topk, tokens):
    path, expected = tiny
    spec = SpecConfig("ngram", spec_num_steps=5, spec_topk=topk, spec_num_draft_tokens=tokens,
                      spec_ngram_min_match=1, spec_adaptive=adaptive)
    outs, _ = run(path, spec, PROMPTS)
    assert [o.token_ids for o in outs] == expected
    assert sum(o.spec_accepted_tokens for o in outs) > 0  # tiny models loop: n-grams hit
    for p, e in zip(PROMPTS, expected):  # alone equals batched
        assert run(path, spec, [p])[0][0].token_ids == e


@pytest.mark.parametrize("algorithm", ["eagle3", "mtp"])
def test_hybrid_is_lossless(tiny, tmp_path, algorithm):
    path, expected = tiny
    random_draft_checkpoint(str(tmp_path), algorithm, ModelConfig.from_hf(load_checkpoint(path).hf_config), seed=1)
    # pinned: a random head's measured costs may rightly keep an unpinned policy at depth 0 throughout
    spec = SpecConfig(algorithm, draft_model=str(tmp_path), spec_num_steps=3, spec_topk=2, spec_num_draft_tokens=6,
                      spec_ngram=True, spec_ngram_min_match=1, spec_adaptive_pinned=True)
    outs, engine = run(path, spec, PROMPTS)
    assert [o.token_ids for o in outs] == expected
    # a random head accepts ~nothing; the n-gram half of the tree carries the acceptance
    assert sum(o.spec_accepted_tokens for o in outs) > 0


def test_ngram_on_smollm2_is_lossless_and_copies():
    ckpt = load_checkpoint("default")
    tok = ckpt.tokenizer
    text = ("Repeat this sentence exactly: The quick brown fox jumps over the lazy dog near the old farm "
            "house while the farmer sleeps.")
    prompt = tok.encode(tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True),
                        add_special_tokens=False)
    params = SamplingParams(max_tokens=32, temperature=0.0)
    cache = CacheConfig(page_size=16, num_pages=64)
    base = LLMEngine(EngineConfig(model="default", cache=cache), checkpoint=ckpt).generate([prompt], params)[0]
    for spec in (SpecConfig("ngram", spec_adaptive=False), SpecConfig("ngram")):
        engine = LLMEngine(EngineConfig(model="default", cache=cache, spec=spec), checkpoint=ckpt)
        out = engine.generate([prompt, prompt[:-3]], params)
        assert out[0].token_ids == base.token_ids
        if not spec.spec_adaptive:  # (adaptive depth depends on the costs measured on this machine)
            assert out[0].spec_accept_length > 2.0, out[0].spec_accept_length  # the answer copies the prompt
        assert engine.free_pages == engine.total_pages
