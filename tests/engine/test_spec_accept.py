"""Acceptance estimates (spec_accept.py): the prior a new request starts from."""
from specpd.engine.spec_accept import AcceptanceEstimates


def test_a_new_requests_prior_is_the_per_request_average_not_the_last_requests_tail():
    """Requests accepting half their depth-1 proposals, then one whose last rounds all accept (a reply that
    repeats itself): the per-observation rate ends near 1, a new request starts from the per-request average
    (~0.5). A useless draft's misses bring the per-observation rate down at once, and new requests with it."""
    est = AcceptanceEstimates(3, 1, 4)
    for r in range(10):
        for i in range(20):
            est.observe(f"r{r}", 1, i % 2)
        est.forget(f"r{r}")
    for _ in range(20):
        est.observe("tail", 1, 1)
    assert est.global_accept[0] > 0.85
    assert est.accept_rates("new")[0] == est.request_accept < 0.6  # (no rounds of its own: its prior alone)
    for _ in range(20):
        est.observe("tail", 1, 0)
    assert est.accept_rates("newer")[0] == est.global_accept[0] < 0.15


def test_frozen_estimates_learn_nothing_engine_wide():
    est = AcceptanceEstimates(3, 1, 4, frozen=True)
    for _ in range(20):
        est.observe("old", 3, 3)
    est.forget("old")
    assert est.global_accept == [0.5] * 3 and est.request_accept == 0.5
