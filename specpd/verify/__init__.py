"""Verify: draft tree shape (tree), greedy acceptance (greedy), lossless rejection sampling (rejection).

Pure functions over tensors; the vocabulary (proposed, accepted, rejected, bonus, tau) is defined in
specpd.verify.rejection.
"""
