"""Greedy verify (temperature 0): the longest tree path that matches the target's argmax.

Vocabulary (proposed / accepted / rejected / bonus, tau) is defined in specpd.spec.verify.rejection.
"""
from __future__ import annotations

import torch

from specpd.spec.tree import DraftTree


def verify_greedy(tree: DraftTree, target_argmax: torch.Tensor) -> tuple[list[int], int]:
    """target_argmax [T] long: the target's argmax at every node.

    Walk from the root; at each node descend into the first child (sibling order) whose token equals
    the target's argmax there. Returns (accepted node ids root excluded, bonus token = the argmax at
    the last accepted node, or at the root if none was accepted).
    """
    tokens = tree.token_list
    argmax = target_argmax.tolist()
    children: list[list[int]] = [[] for _ in tokens]
    for node, parent in enumerate(tree.parent_list):
        if parent >= 0:
            children[parent].append(node)
    node, accepted = 0, []
    while True:
        match = next((c for c in children[node] if tokens[c] == argmax[node]), None)
        if match is None:
            return accepted, argmax[node]
        accepted.append(match)
        node = match
