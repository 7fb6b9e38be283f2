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


def test_a_level_never_tried_follows_the_level_above():
    """Rounds that only ever reach depth 2, all accepted (a copied span): the engine-wide rates of depths 1-2 rise
    to ~1 and depth 3 is never observed. Its trend is the level above's, so a request that accepts everything
    is expected to go on accepting at depth 3 (before, depth 3 kept the 0.5 prior and the trend 0.5 / ~1 halved
    it: no request ever tried depth 3)."""
    est = AcceptanceEstimates(4, 1, 5)
    for _ in range(40):
        est.observe("copy", 2, 2)
    assert est.global_accept[0] > 0.95 and est.global_accept[1] > 0.95 and est.global_seen[2:] == [0, 0]
    rates = est.accept_rates("copy")
    assert rates[2] > 0.9 and rates[3] > 0.9
    est.observe("copy", 3, 2)  # depth 3 tried and missed: its engine-wide rate starts from depth 2's, then learns
    assert est.global_seen[2] == 1 and 0.8 < est.global_accept[2] < est.global_accept[1]


def test_a_narrow_chain_that_keeps_accepting_is_expected_to_go_deeper():
    """A tree-shaped drafter (K = 2) whose requests take narrow rounds (the top path) that accept all 3 of their
    proposals: the narrow estimate one level deeper than tried follows the request's own narrow rate, not the
    full width's prior times the top path's share (~0.4 here, which kept it at depth 3 for good)."""
    est = AcceptanceEstimates(6, 2, 12)
    est._narrow["copy"] = True
    for _ in range(30):
        est.observe("copy", 3, 3)
    narrow = est.accept_rates("copy", narrow=True)
    assert narrow[0] > 0.8 and min(narrow[1:3]) > 0.9  # (depth 1 shrunk towards its prior, 0.375)
    assert narrow[3] > 0.9 and narrow[4] > 0.9
    assert est.accept_rates("fresh", narrow=True)[3] < 0.5  # a request with no rounds keeps the cautious prior


def test_a_request_at_depth_zero_drifts_back_to_the_engine_wide_rate():
    """Its last verifies missed while the engine's accept ~0.6 (the text moved on): sitting at depth 0 it observes
    nothing, and forgetting per outcome alone kept its estimate there for the rest of its reply. Its idle rounds
    decay its statistics, so within a few dozen it is back near the engine-wide rate (and speculates if that pays);
    a frozen estimate (pinned tests, PD = unified) does not move."""
    for frozen in (False, True):
        est = AcceptanceEstimates(2, 1, 3, frozen=frozen)
        for _ in range(8):
            est.observe("r", 1, 0)
        est.global_accept, est.request_accept = [0.6, 0.6], 0.6  # (the engine's other requests)
        low = est.accept_rates("r")[0]
        assert low < 0.3
        st, seen = est._get("r"), est._observed
        for _ in range(48):
            est.idle_round(st, lone=False)  # in a batch: no decay
        assert est.accept_rates("r")[0] == low
        for _ in range(48):
            est.idle_round(st, lone=True)
        if frozen:
            assert est.accept_rates("r")[0] == low and est._observed == seen
        else:
            assert 0.5 < est.accept_rates("r")[0] < 0.6 and est._observed == seen + 6  # (the idle shortcut re-plans)
