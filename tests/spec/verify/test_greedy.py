"""Greedy verify: the longest path matching the target argmax, on hand-built trees."""
import pytest
import torch

from specpd.spec.verify.greedy import verify_greedy
from specpd.spec.tree import DraftTree

#        0:9
#   /     |      \
# 1:1    2:2     3:3
#  |     /  \
# 4:4  5:5  6:6
#             |
#            7:7
TREE = DraftTree(
    tokens=torch.tensor([9, 1, 2, 3, 4, 5, 6, 7]),
    parents=torch.tensor([-1, 0, 0, 0, 1, 2, 2, 6]),
    depth=torch.tensor([0, 1, 1, 1, 2, 2, 2, 3]),
    cum_logprob=torch.zeros(8),
)


def argmax_at(**by_node):
    """Target argmax per node; nodes not named predict token 0 (no draft token is 0)."""
    out = torch.zeros(8, dtype=torch.long)
    for node, tok in by_node.items():
        out[int(node[1:])] = tok
    return out


@pytest.mark.parametrize("argmax,accepted,bonus", [
    (argmax_at(n0=8), [], 8),  # accept none: bonus is the root's argmax
    (argmax_at(n0=1, n1=0), [1], 0),  # partial along sibling rank 0
    (argmax_at(n0=1, n1=4, n4=11), [1, 4], 11),  # down to a leaf: bonus from the leaf
    (argmax_at(n0=2, n2=6, n6=7, n7=42), [2, 6, 7], 42),  # full depth through rank-1 siblings
    (argmax_at(n0=3, n3=5), [3], 5),  # rank-2 leaf; token 5 exists elsewhere but not under node 3
    (argmax_at(n0=2, n2=5, n5=1), [2, 5], 1),
])
def test_greedy_tree(argmax, accepted, bonus):
    assert verify_greedy(TREE, argmax) == (accepted, bonus)


def test_greedy_chain():
    chain = DraftTree.chain(9, [1, 2, 3])
    assert verify_greedy(chain, torch.tensor([1, 2, 3, 4])) == ([1, 2, 3], 4)
    assert verify_greedy(chain, torch.tensor([1, 2, 0, 4])) == ([1, 2], 0)
    assert verify_greedy(chain, torch.tensor([5, 2, 3, 4])) == ([], 5)
