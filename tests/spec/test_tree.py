"""Draft tree shape: EAGLE-2 growth and pruning, ancestor closure, masks, positions, verify inputs."""
import itertools

import pytest
import torch

from specpd.spec.tree import DraftTree, TreeBuilder, build_verify_inputs, draft_logp, kv_moves


def grow(builder: TreeBuilder, probs_for) -> DraftTree:
    """Expand every step with probs_for(pool id, token) -> (ids [K], probs [K])."""
    while not builder.done:
        frontier = builder.frontier()
        pairs = [probs_for(int(n), int(builder.tokens[n])) for n in frontier]
        builder.expand(torch.stack([p[0] for p in pairs]), torch.stack([p[1] for p in pairs]))
    return builder.finalize()


def check_structure(tree: DraftTree) -> None:
    parents = tree.parents.tolist()
    assert parents[0] == -1 and tree.depth[0] == 0
    for i in range(1, tree.num_nodes):
        assert 0 <= parents[i] < i, "parents precede children"
        assert tree.depth[i] == tree.depth[parents[i]] + 1


def test_topk1_is_a_chain():
    b = TreeBuilder(7, topk=1, num_steps=4, num_draft_tokens=5)
    tree = grow(b, lambda n, tok: (torch.tensor([tok + 1]), torch.tensor([0.5])))
    assert tree.tokens.tolist() == [7, 8, 9, 10, 11]
    assert tree.parents.tolist() == [-1, 0, 1, 2, 3]
    assert tree.depth.tolist() == [0, 1, 2, 3, 4]
    assert torch.allclose(tree.cum_logprob, torch.arange(5) * torch.log(torch.tensor(0.5)))
    chain = DraftTree.chain(7, [8, 9, 10, 11])
    assert chain.parents.tolist() == tree.parents.tolist() and chain.tokens.tolist() == tree.tokens.tolist()
    # fewer draft tokens than steps: the chain is cut, never a gap
    short = grow(TreeBuilder(7, topk=1, num_steps=4, num_draft_tokens=3),
                 lambda n, tok: (torch.tensor([tok + 1]), torch.tensor([1.0])))
    assert short.tokens.tolist() == [7, 8, 9] and short.parents.tolist() == [-1, 0, 1]


def test_frontier_and_best_nodes_by_cumulative_prob():
    """topk=2, 3 steps, keep root + 5. Children of pool node n: tokens 10n+1, 10n+2."""
    table = {0: [0.6, 0.3], 1: [0.5, 0.4], 2: [0.9, 0.1], 3: [0.7, 0.2], 5: [0.95, 0.05]}
    b = TreeBuilder(0, topk=2, num_steps=3, num_draft_tokens=6)
    assert b.frontier().tolist() == [0]
    b.expand(torch.tensor([[1, 2]]), torch.tensor([table[0]]))  # pool 1: .6, pool 2: .3
    assert b.frontier().tolist() == [1, 2]
    b.expand(torch.tensor([[11, 12], [21, 22]]), torch.tensor([table[1], table[2]]))
    # pool 3: .30, 4: .24, 5: .27, 6: .03 -> best two are 3 and 5
    assert b.frontier().tolist() == [3, 5]
    b.expand(torch.tensor([[111, 112], [211, 212]]), torch.tensor([table[3], table[5]]))
    # pool 7: .21, 8: .06, 9: .2565, 10: .0135
    assert b.num_nodes == 1 + 2 + 2 * 4
    tree = b.finalize()
    # best five: 1 (.6), 2 (.3), 3 (.3), 5 (.27), 9 (.2565); 4 (.24) and 7 (.21) miss out
    assert tree.tokens.tolist() == [0, 1, 2, 11, 21, 211]
    assert tree.parents.tolist() == [-1, 0, 0, 1, 2, 4]
    assert tree.depth.tolist() == [0, 1, 1, 2, 2, 3]
    assert torch.allclose(tree.cum_logprob.exp(), torch.tensor([1, 0.6, 0.3, 0.3, 0.27, 0.2565]))
    check_structure(tree)


@pytest.mark.parametrize("topk,num_steps", [(2, 3), (3, 3), (4, 2)])
def test_ancestor_closed_under_ties(topk, num_steps):
    """Equal probs everywhere, and p == 1 (child ties its parent), for every tree size."""
    pool = 1 + topk + (num_steps - 1) * topk * topk
    for prob, t in itertools.product([1.0 / topk, 1.0, 1.0 + 1e-7], range(2, pool + 2)):
        b = TreeBuilder(0, topk=topk, num_steps=num_steps, num_draft_tokens=t)
        tree = grow(b, lambda n, tok: (torch.arange(topk) + 10 * n, torch.full((topk,), prob)))
        assert tree.num_nodes == min(t, pool)
        check_structure(tree)  # every kept node's parent is kept and comes first


def test_attention_mask_equals_the_torch_walk_it_replaced():
    """The mask built in Python equals the torch walk it replaced (tests/spec/tree_reference.py), on random
    trees from a lone root to 33 nodes."""
    from tests.spec.tree_reference import random_tree, torch_attention_mask
    gen = torch.Generator().manual_seed(0)
    for n in (1, 2, 5, 12, 33):
        for _ in range(20):
            tree = random_tree(gen, n)
            mask = tree.attention_mask()
            assert mask.dtype == torch.bool and torch.equal(mask, torch_attention_mask(tree))


def test_mask_is_ancestor_relation_and_positions():
    gen = torch.Generator().manual_seed(0)
    b = TreeBuilder(3, topk=3, num_steps=4, num_draft_tokens=12)
    tree = grow(b, lambda n, tok: (torch.arange(3), torch.rand(3, generator=gen).sort(descending=True).values))
    check_structure(tree)
    mask = tree.attention_mask()
    for i in range(tree.num_nodes):
        path = set(tree.path_to(i))
        assert tree.path_to(i)[0] == 0 and tree.path_to(i)[-1] == i
        assert set(mask[i].nonzero().flatten().tolist()) == path
        assert tree.children(i) == [j for j in range(tree.num_nodes) if tree.parents[j] == i]
        row = tree.children_table()[i].tolist()
        assert [c for c in row if c >= 0] == tree.children(i)
    assert tree.positions(100).tolist() == (100 + tree.depth).tolist()
    kv = tree.kv_mask(5)
    assert kv.shape == (12, 17) and kv[:, :5].all() and torch.equal(kv[:, 5:], mask)


def test_build_verify_inputs_and_kv_moves():
    a = DraftTree.chain(4, [5, 6])
    b = DraftTree(torch.tensor([9, 1, 2, 3]), torch.tensor([-1, 0, 0, 1]), torch.tensor([0, 1, 1, 2]), torch.zeros(4))
    inputs = build_verify_inputs([a, b], [10, 20])
    assert inputs.input_ids.tolist() == [4, 5, 6, 9, 1, 2, 3]
    assert inputs.positions.tolist() == [10, 11, 12, 20, 21, 21, 22]
    assert inputs.qo_indptr.tolist() == [0, 3, 7]
    assert inputs.q_lens == [3, 4] and inputs.kv_lens == [13, 24]
    assert torch.equal(inputs.tree_masks[1], b.attention_mask())
    assert kv_moves([1, 2]) == [] and kv_moves([2]) == [(2, 1)] and kv_moves([1, 3]) == [(3, 2)]


def test_builder_rejects_misuse():
    b = TreeBuilder(0, topk=2, num_steps=1, num_draft_tokens=3)
    with pytest.raises(ValueError, match=r"\[1, 2\]"):
        b.expand(torch.tensor([[1, 2, 3]]), torch.tensor([[0.5, 0.3, 0.2]]))
    with pytest.raises(ValueError, match="topk == 1"):
        b.expand(torch.tensor([[1, 2]]), torch.tensor([[0.5, 0.3]]), torch.full((1, 2, 4), 0.25))
    b.expand(torch.tensor([[1, 2]]), torch.tensor([[0.5, 0.3]]))
    with pytest.raises(RuntimeError, match="done"):
        b.frontier()
    with pytest.raises(ValueError, match="num_draft_tokens"):
        TreeBuilder(0, topk=1, num_steps=1, num_draft_tokens=1)


def test_sampled_chain_keeps_proposals():
    q = torch.softmax(torch.randn(3, 5, generator=torch.Generator().manual_seed(1)), -1)
    b = TreeBuilder(0, topk=1, num_steps=3, num_draft_tokens=4)
    for step in range(3):
        b.expand(torch.tensor([[step + 1]]), q[step, step + 1].view(1, 1), q[step].view(1, 1, 5))
    tree = b.finalize()
    assert torch.equal(tree.proposal_probs[1:], q) and tree.proposal_probs[0].sum() == 0
    assert torch.equal(tree.proposal_probs, DraftTree.chain(0, [1, 2, 3], proposal_probs=q).proposal_probs)


@pytest.mark.parametrize("topk,num_steps,num_draft_tokens", [(1, 4, 5), (2, 3, 6), (4, 2, 5), (4, 4, 10), (3, 3, 40)])
def test_the_list_builder_grows_the_torch_builders_trees(topk, num_steps, num_draft_tokens):
    """The list-backed builder against the torch one it replaced (tests/spec/tree_reference.py), expand by
    expand: the same frontiers and new ids, the same finalized tree bit for bit. Probabilities drawn to tie (a
    few distinct values, repeated), with zeros (log -inf) and NaN (scored -inf), and from a softmax; chains with
    sampled proposals too."""
    from tests.spec.tree_reference import TorchTreeBuilder
    gen = torch.Generator().manual_seed(topk * 100 + num_steps * 10 + num_draft_tokens)
    for trial in range(60):
        fast, ref = TreeBuilder(3, topk, num_steps, num_draft_tokens), TorchTreeBuilder(3, topk, num_steps,
                                                                                           num_draft_tokens)
        sampled = topk == 1 and trial % 2 == 1
        while not ref.done:
            frontier = ref.frontier()
            assert fast.frontier_ids() == frontier.tolist() and torch.equal(fast.frontier(), frontier)
            shape = (len(frontier), topk)
            ids = torch.randint(0, 50, shape, generator=gen)
            if trial % 3 == 0:  # ties: a few values, repeated
                probs = torch.tensor([0.5, 0.25, 0.125, 0.0])[torch.randint(0, 4, shape, generator=gen)]
            elif trial % 3 == 1:
                probs = torch.rand(shape, generator=gen)
                probs[torch.rand(shape, generator=gen) < 0.1] = float("nan")
            else:
                probs = torch.randn(shape[0], 64, generator=gen).softmax(-1).topk(topk, dim=-1).values
            proposal = torch.rand(*shape, 8, generator=gen) if sampled else None
            if trial % 4 == 2:  # what the EAGLE drafter calls: a level's scores converted once, as lists
                got = fast.expand_logp(ids.tolist(), draft_logp(probs))
            else:
                got = fast.expand(ids, probs, proposal) if trial % 2 else fast.expand_ids(ids.tolist(), probs,
                                                                                         proposal)
            want = ref.expand(ids, probs, proposal)
            assert list(got) == want.tolist()
        assert torch.equal(fast.tokens, ref.tokens) and torch.equal(fast.parents, ref.parents)
        assert torch.equal(fast.depth, ref.depth) and torch.equal(fast.cum_logprob, ref.cum_logprob)
        a, b = fast.finalize(), ref.finalize()
        for name in ("tokens", "parents", "depth", "cum_logprob"):
            x, y = getattr(a, name), getattr(b, name)
            assert x.dtype == y.dtype and torch.equal(x, y), (name, x, y)
        assert (a.token_list, a.parent_list, a.depth_list, a.cum_list) == \
            (b.tokens.tolist(), b.parents.tolist(), b.depth.tolist(), b.cum_logprob.tolist())
        assert (a.proposal_probs is None) == (b.proposal_probs is None)
        if a.proposal_probs is not None:
            assert torch.equal(a.proposal_probs, b.proposal_probs)


def test_a_tree_reads_as_tensors_or_lists_whichever_it_was_given():
    """DraftTree from lists makes each tensor on first use (long / float32, on its device) and from tensors each
    list; either way both views agree, a mixed tree too, and a field of the wrong length is refused."""
    lists = ([5, 6, 7, 8], [-1, 0, 0, 1], [0, 1, 1, 2], [0.0, -0.5, -1.25, -0.75])
    tensors = (torch.tensor(lists[0]), torch.tensor(lists[1]), torch.tensor(lists[2]), torch.tensor(lists[3]))
    for given in (lists, tensors, (lists[0], tensors[1], lists[2], tensors[3])):
        tree = DraftTree(*given)
        assert tree.num_nodes == 4 and tree.max_depth == 2 and tree.device == torch.device("cpu")
        assert (tree.token_list, tree.parent_list, tree.depth_list, tree.cum_list) == lists
        for name, want in zip(("tokens", "parents", "depth", "cum_logprob"), tensors):
            got = getattr(tree, name)
            assert got.dtype == want.dtype and torch.equal(got, want), name
        assert tree.tokens is tree.tokens  # made once
        assert torch.equal(tree.attention_mask(), DraftTree(*tensors).attention_mask())
    with pytest.raises(ValueError, match=r"parents must have shape \[4\], got \(3,\)"):
        DraftTree(lists[0], [-1, 0, 0], lists[2], lists[3])
    with pytest.raises(ValueError, match=r"depth must have shape \[4\]"):
        DraftTree(tensors[0], tensors[1], torch.zeros(5, dtype=torch.long), lists[3])
