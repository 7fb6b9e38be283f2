"""Proposers: what drafts the tree a verify forward checks.

A proposer keeps per-request draft state in step with the target:
  1. `extend` runs after every target forward that committed tokens (prefill chunks, and the
     accepted path after each verify). Draft position i takes token x_{i+1} with the target's hidden
     state at position i; the extend's last row yields the first-round top-k proposal and the draft
     hidden for the next round. Over a prompt the inputs are prompt[1:] + [handoff token] (the handoff token
     is y0, sampled after the prompt's last position: docs/architecture.md, "The handoff contract").
  2. `propose` drafts `num_steps` levels from that state and returns one DraftTree per request.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch

from specpd.core import Request
from specpd.spec.tree import draft_logp


@dataclass
class DraftState:
    """Per-request draft state between rounds (stored on request.spec_state)."""

    topk_ids: list[int]  # [K] target-vocab ids proposed for the token after the last committed one
    topk_probs: list[float]  # [K] their draft probabilities
    hidden: torch.Tensor | None  # [H] draft hidden at the last extended position (None for replay)
    topk_logp: list[float] | None = None  # [K] their scores, draft_logp(topk_probs), where the extend made them

    def logp(self) -> list[float]:
        """The top-k's scores as a draft tree adds them up (verify.tree.draft_logp)."""
        if self.topk_logp is None:
            self.topk_logp = draft_logp(torch.tensor([self.topk_probs]))[0]
        return self.topk_logp


@dataclass
class DraftExtend:
    """One request's slice of a draft extend."""

    request: Request
    start: int  # first draft position (== the target positions whose hiddens are given)
    token_ids: list[int]  # [n] x_{start+1} .. x_{start+n}
    hidden: torch.Tensor | None  # [n, Hin] target features at positions start .. start+n-1
    at_end: bool  # the slice reaches the last committed token: refresh the proposal


class Proposer(ABC):
    def __init__(self, num_steps: int, topk: int, num_draft_tokens: int):
        self.num_steps = num_steps
        self.topk = topk
        self.num_draft_tokens = num_draft_tokens

    @property
    def aux_layer_ids(self) -> tuple[int, ...]:
        """Target layers whose input hiddens the proposer needs (EAGLE-3); empty: final hidden."""
        return ()

    @property
    def needs_hidden(self) -> bool:
        """The target's features at committed positions (a draft model consumes them)."""
        return not self.model_free

    @property
    def scratch_width(self) -> int:
        """KV slots past the root the drafting itself writes (EAGLE trees: one per frontier node a step)."""
        return (self.num_steps - 1) * self.topk

    @property
    def model_free(self) -> bool:
        """No draft model: nothing to run on a PD prefill server, no draft KV, no draft state to hand off."""
        return False

    @abstractmethod
    def extend(self, extends: list[DraftExtend]) -> None:
        ...

    @abstractmethod
    def propose(self, requests: list[Request], starts: list[int], plans=None) -> list:
        """One DraftTree per request; node 0 is the root (the last committed token, position start).
        plans: per request (num_steps, num_draft_tokens) for this round, 0 steps = a root-only tree;
        None = the proposer's own shape for every request."""

    def release(self, request: Request) -> None:
        request.spec_state = None
