"""Rejection sampling keeps the target distribution: chi-square fits of the first two committed tokens.

The "language models" are Markov tables over a tiny vocabulary: the target's next-token distribution
at a node with token x is P[x] (processed by process_logits), the drafter's is Q[x]. Each test runs
N independent decodes, vectorized through the batched reference, until two tokens are committed
(a second verify round when the first commits only its bonus), and checks that the pair follows
P[ROOT](x1) * P[x1](x2). Deliberately broken samplers must fail the same fit.
"""
import pytest
import torch

from specpd.core import SamplingParams
from specpd.model.sampler import SamplingRow, process_logits
from specpd.spec.verify import rejection
from specpd.spec.verify.greedy import verify_greedy
from specpd.spec.verify.rejection import VerifyResult, tree_rejection_sample, verify_tree, verify_trees
from specpd.spec.tree import DraftTree, TreeBuilder

V, ROOT, N = 6, 0, 40_000


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """These tensors are tiny: intra-op threads only thrash on a busy machine (20x slower here)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def markov_tables(params: SamplingParams, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """P [V, V] processed target rows, Q [V, V] drafter rows (correlated with the target, not equal)."""
    gen = torch.Generator().manual_seed(seed)
    target_logits = torch.randn(V, V, generator=gen)
    draft_logits = target_logits + torch.randn(V, V, generator=gen)
    P = process_logits(target_logits.clone(), [SamplingRow(params, [], [], None)] * V)
    return P, torch.softmax(draft_logits, dim=-1)


def run_round(P, children, tokens, proposal, gen):
    """One batched verify; returns committed tokens [n, depth + 1] padded with -1, and accept_len [n]."""
    n, t, _ = children.shape
    offsets = torch.arange(n) * t
    flat = None if proposal is None else proposal.reshape(n * t, V)
    accepted, bonus = tree_rejection_sample(children, tokens, offsets, P[tokens].view(n * t, V), flat,
                                            torch.rand(n, t, generator=gen), max_depth=2)
    accept_len = (accepted >= 0).sum(1)
    committed = torch.where(accepted >= 0, tokens.gather(1, accepted.clamp(min=0)), -1)
    committed = torch.cat([committed, torch.full((n, 1), -1)], dim=1)
    committed[torch.arange(n), accept_len] = bonus
    return committed, accept_len


def sampled_chain(P, Q, roots, gen):
    """Two draft tokens, each sampled from Q at its parent."""
    d1 = torch.multinomial(Q[roots], 1, generator=gen).squeeze(1)
    d2 = torch.multinomial(Q[d1], 1, generator=gen).squeeze(1)
    n = roots.shape[0]
    children = torch.tensor([[1], [2], [-1]]).expand(n, 3, 1)
    proposal = torch.stack([torch.zeros(n, V), Q[roots], Q[d1]], dim=1)
    return run_round(P, children, torch.stack([roots, d1, d2], 1), proposal, gen)


def sampled_tree(P, Q, roots, gen, replacement):
    """Two children per node, depth 2 (nodes 1,2 under 0; 3,4 under 1; 5,6 under 2), no pruning.
    Siblings are drawn from Q at the parent, with or without replacement."""
    n = roots.shape[0]
    tokens, proposal = [roots], [torch.zeros(n, V)]

    def draw(parent):
        q = Q[parent]
        pair = torch.multinomial(q, 2, replacement=replacement, generator=gen)
        second = q if replacement else q.scatter(1, pair[:, :1], 0.0)
        tokens.extend([pair[:, 0], pair[:, 1]])
        proposal.extend([q, second / second.sum(1, keepdim=True)])
        return pair

    level1 = draw(roots)
    draw(level1[:, 0])
    draw(level1[:, 1])
    children = torch.tensor([[1, 2], [3, 4], [5, 6], [-1, -1], [-1, -1], [-1, -1], [-1, -1]]).expand(n, 7, 2)
    return run_round(P, children, torch.stack(tokens, 1), torch.stack(proposal, 1), gen)


def topk_tree(P, Q, roots, gen, topk, num_draft_tokens):
    """EAGLE-2 trees from the drafter's top-k (deterministic proposals), one per possible root."""
    children, tokens = [], []
    for root in range(V):
        b = TreeBuilder(root, topk=topk, num_steps=2, num_draft_tokens=num_draft_tokens)
        while not b.done:
            top = Q[b.tokens[b.frontier()]].topk(topk, dim=-1)
            b.expand(top.indices, top.values)
        tree = b.finalize()
        children.append(tree.children_table(width=topk))
        tokens.append(tree.tokens)
    return run_round(P, torch.stack(children)[roots], torch.stack(tokens)[roots], None, gen)


def first_two_counts(round_fn, seed=1):
    """[V, V] counts of the first two committed tokens over N decodes, and the first round's accept_len."""
    gen = torch.Generator().manual_seed(seed)
    committed, accept_len = round_fn(torch.full((N,), ROOT), gen)
    x1, x2 = committed[:, 0], committed[:, 1].clone()
    only_bonus = x2 < 0
    x2[only_bonus] = round_fn(x1[only_bonus], gen)[0][:, 0]
    return torch.bincount(x1 * V + x2, minlength=V * V).view(V, V).double(), accept_len


def fit_pvalue(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Chi-square goodness of fit; zero-probability cells must be empty, cells expecting < 5 are pooled."""
    counts, probs = counts.flatten().double(), probs.flatten().double()
    assert counts[probs == 0].sum() == 0, "a token with zero target probability was committed"
    expected = probs * counts.sum()
    big, small = expected >= 5, (expected > 0) & (expected < 5)
    obs = torch.cat([counts[big], counts[small].sum().view(1)])
    exp = torch.cat([expected[big], expected[small].sum().view(1)])
    obs, exp = obs[exp > 0], exp[exp > 0]
    chi2 = ((obs - exp) ** 2 / exp).sum()
    dof = torch.tensor((obs.numel() - 1) / 2, dtype=torch.float64)
    return float(torch.special.gammaincc(dof, chi2 / 2))


def pvalues(P, counts):
    """(first token alone, first two jointly)."""
    joint = P[ROOT].unsqueeze(1) * P
    return fit_pvalue(counts.sum(1), P[ROOT]), fit_pvalue(counts, joint)


TEMP1 = SamplingParams(temperature=1.0)
PROCESSED = SamplingParams(temperature=0.7, top_p=0.8)
SCHEMES = {
    "sampled_chain": sampled_chain,
    "sampled_tree_without_replacement": lambda P, Q, r, g: sampled_tree(P, Q, r, g, replacement=False),
    "sampled_tree_iid": lambda P, Q, r, g: sampled_tree(P, Q, r, g, replacement=True),
    "topk2_tree": lambda P, Q, r, g: topk_tree(P, Q, r, g, topk=2, num_draft_tokens=5),
    "topk3_tree": lambda P, Q, r, g: topk_tree(P, Q, r, g, topk=3, num_draft_tokens=8),
}


@pytest.mark.parametrize("params", [TEMP1, PROCESSED], ids=["temperature1", "temp0.7_top_p0.8"])
@pytest.mark.parametrize("scheme", list(SCHEMES))
def test_committed_tokens_follow_target(scheme, params):
    P, Q = markov_tables(params)
    counts, accept_len = first_two_counts(lambda roots, gen: SCHEMES[scheme](P, Q, roots, gen))
    first, pair = pvalues(P, counts)
    assert first > 0.01 and pair > 0.01, (first, pair)
    # rejections and acceptances both happen
    assert (accept_len < 2).float().mean() > 0.05 and (accept_len > 0).float().mean() > 0.05


def accept_q_over_p(coin, r_tok, q_tok):
    return coin * r_tok < q_tok


def residual_not_updated(r, q, fallback):
    return r


def residual_not_renormalized(r, q, fallback):
    return (r - q).clamp(min=0.0)


def bonus_from_target(r, q, fallback):
    return fallback


@pytest.mark.parametrize("scheme,name,broken", [
    ("sampled_chain", "_accept", accept_q_over_p),
    ("sampled_chain", "_residual", bonus_from_target),
    ("topk3_tree", "_residual", residual_not_updated),
    ("topk3_tree", "_residual", residual_not_renormalized),
    ("sampled_tree_without_replacement", "_residual", residual_not_updated),
])
def test_broken_sampler_fails_the_fit(monkeypatch, scheme, name, broken):
    monkeypatch.setattr(rejection, name, broken)
    P, Q = markov_tables(TEMP1)
    counts, _ = first_two_counts(lambda roots, gen: SCHEMES[scheme](P, Q, roots, gen))
    assert min(pvalues(P, counts)) < 0.01


def random_tree(gen, topk=3, num_steps=3, num_draft_tokens=9, vocab=V) -> DraftTree:
    b = TreeBuilder(int(torch.randint(vocab, (1,), generator=gen)), topk, num_steps, num_draft_tokens)
    while not b.done:
        f = b.frontier().shape[0]
        probs = torch.rand(f, vocab, generator=gen).softmax(-1).topk(topk)
        b.expand(probs.indices, probs.values)
    return b.finalize()


def test_one_hot_target_reduces_to_greedy():
    gen = torch.Generator().manual_seed(3)
    for _ in range(50):
        tree = random_tree(gen)
        argmax = torch.randint(V, (tree.num_nodes,), generator=gen)
        result = verify_tree(tree, torch.nn.functional.one_hot(argmax, V).float(), gen)
        assert (result.accepted_nodes, result.bonus_token) == verify_greedy(tree, argmax)


def test_verify_trees_ragged_batch_greedy_rows_and_seeds():
    gen = torch.Generator().manual_seed(4)
    q = torch.softmax(torch.randn(3, V, generator=gen), -1)
    trees = [random_tree(gen), DraftTree.chain(1, [2, 3, 4], proposal_probs=q),
             random_tree(gen, topk=2, num_draft_tokens=4), DraftTree.chain(5, [])]
    probs = torch.softmax(torch.randn(sum(t.num_nodes for t in trees), V, generator=gen), -1)
    greedy = [False, False, True, False]

    def run(seed):
        gens = [torch.Generator().manual_seed(seed + b) for b in range(4)]
        return verify_trees(trees, probs, gens, greedy), gens

    first, gens = run(10)
    again, _ = run(10)
    assert first == again
    # each sampled request consumed exactly T uniforms; the greedy one none
    for b, tree in enumerate(trees):
        fresh = torch.Generator().manual_seed(10 + b)
        if not greedy[b]:
            torch.rand(tree.num_nodes, generator=fresh)
        assert torch.equal(torch.rand(1, generator=gens[b]), torch.rand(1, generator=fresh))
    rows = probs.split([t.num_nodes for t in trees])
    # a request's outcome does not depend on its batchmates (the top-k tree shares a batch with a
    # sampled chain, so its one-hot proposals are spelled out there)
    for b in (0, 1, 3):
        assert verify_tree(trees[b], rows[b], torch.Generator().manual_seed(10 + b)) == first[b]
    assert (first[2].accepted_nodes, first[2].bonus_token) == verify_greedy(trees[2], rows[2].argmax(-1))
    assert first[3] == VerifyResult([], [], first[3].bonus_token, [])
    for tree, result in zip(trees, first):
        assert result.accepted_tokens == tree.tokens[result.accepted_nodes].tolist()
        if result.accepted_nodes:
            assert tree.path_to(result.accepted_nodes[-1])[1:] == result.accepted_nodes
        assert result.committed_tokens == result.accepted_tokens + [result.bonus_token]
        assert result.accept_flags == [d < result.accept_len for d in range(tree.max_depth)]
    with pytest.raises(ValueError, match="rows"):
        verify_trees(trees, probs[1:])


def test_certain_target_accepts_whole_path():
    """p puts all mass on the rank-1 sibling at every level: that path is always accepted."""
    tree = DraftTree(torch.tensor([0, 1, 2, 3, 4]), torch.tensor([-1, 0, 0, 2, 2]), torch.tensor([0, 1, 1, 2, 2]),
                     torch.zeros(5))
    p = torch.full((5, V), 0.0)
    p[0, 2] = p[2, 4] = p[1, 5] = p[3, 5] = p[4, 5] = 1.0
    result = verify_tree(tree, p, torch.Generator().manual_seed(0))
    assert result == VerifyResult([2, 4], [2, 4], 5, [True, True])
    assert result.accept_len == 2 and result.committed_tokens == [2, 4, 5]


def test_degenerate_residual_and_sampling_edges():
    r = torch.tensor([[0.5, 0.5, 0.0]])
    fallback = torch.tensor([[0.2, 0.3, 0.5]])
    assert torch.equal(rejection._residual(r, r.clone(), fallback), fallback)
    assert torch.allclose(rejection._residual(r, torch.tensor([[1.0, 0, 0]]), fallback), torch.tensor([[0.0, 1, 0]]))
    probs = torch.tensor([[0.0, 0.7, 0.3, 0.0], [0.0, 0.7, 0.3, 0.0]])
    top = torch.tensor([1 - 2 ** -24, 0.0])
    assert rejection._sample(probs, top).tolist() == [2, 1]
