"""Verify: greedy acceptance (greedy), lossless rejection sampling (rejection), over a DraftTree (specpd.spec.tree).

Pure functions over tensors, importing nothing from specpd but the tree; the vocabulary (proposed, accepted,
rejected, bonus, tau) is defined in specpd.spec.verify.rejection. Which path a request commits, and the commit
itself, is specpd.spec.commit's.
"""
