"""Structured outputs: JSON-schema / regex / choice / EBNF constraints (xgrammar).

A constrained request's life:
  1. The server parses the constraint fields into one `Constraint` (constraint.py; a 400 names a bad
     field) and compiles it in a worker thread (backend.py; cached per (kind, spec), off the event loop).
  2. SamplingParams carry it as text (`constraint_kind`, `constraint_spec`); `LLMEngine.validate_request`
     compiles it (a cache hit) and `add_request` gives the request its matcher (`Request.grammar`).
  3. Every forward that samples masks the request's rows before any logit processing (matcher.py):
     plain decode and prefill one row, speculative verify every tree node with the state at that node.
  4. `_append` advances the matcher over committed tokens only; EOS is allowed exactly where the grammar
     can end, and accepting it ends the request.
Precedence: the grammar ending ends the request even before `min_tokens` (min_tokens never holds EOS back
from a constrained request); `ignore_eos` with a constraint is a 400; stop strings, stop_token_ids and
max_tokens still end it where they hit, grammar complete or not.
"""
from importlib.metadata import version

from specpd.grammar.constraint import KINDS, Constraint, parse_constraint

__all__ = ["KINDS", "Constraint", "backend_id", "parse_constraint"]


def backend_id() -> str:
    """The grammar backend and its version: PD peers must agree on it (P masks y0, D the rest)."""
    return f"xgrammar=={version('xgrammar')}"
