"""Acceptance estimates (spec_accept.py): the prior a new request starts from."""
from specpd.engine.spec_accept import AcceptanceEstimates


def test_a_new_requests_prior_is_the_lower_of_the_fast_and_the_slow_engine_wide_rate():
    """A run of full acceptance (a reply that repeats itself) lifts the fast engine-wide rate near 1 within a
    few rounds; a request arriving then starts from the slow rate, which has hardly moved. A run of misses (a
    useless draft) brings the fast rate down within a few rounds, and new requests start from it at once."""
    est = AcceptanceEstimates(3, 1, 4)
    for _ in range(20):
        est.observe("old", 3, 3)
    fast, slow = est.global_accept[0], est.slow_accept[0]
    assert fast > 0.9 and slow < 0.85
    new = est.accept_rates("new")[0]
    assert new == slow and new < fast  # (no rounds of its own: its prior alone)
    for _ in range(20):
        est.observe("old", 1, 0)
    assert est.global_accept[0] < est.slow_accept[0]
    assert est.accept_rates("newer")[0] == est.global_accept[0] < 0.15


def test_frozen_estimates_learn_nothing_engine_wide():
    est = AcceptanceEstimates(3, 1, 4, frozen=True)
    for _ in range(20):
        est.observe("old", 3, 3)
    assert est.global_accept == est.slow_accept == [0.5] * 3
