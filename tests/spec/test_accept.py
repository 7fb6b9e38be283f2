"""Acceptance estimates (specpd/spec/accept.py): the prior a new request starts from."""
import pytest

from specpd.spec.accept import AcceptanceEstimates


def test_a_new_requests_prior_is_the_per_request_average_not_the_last_requests_tail():
    """Requests accepting half their depth-1 proposals, then one reply whose last rounds all accept (it repeats
    itself), then one whose last rounds all miss, one at a time (c1): the per-observation rate follows each
    tail (near 1, then near 0), a new request starts from the per-request average (~0.5) either way. At chat c1
    that rate swung 0.3-0.95 request to request, and a request started from its low swings went to depth 0 on its
    first miss."""
    est = AcceptanceEstimates(3, 1, 4)
    for r in range(10):
        for i in range(20):
            est.observe(f"r{r}", 1, i % 2)
        est.forget(f"r{r}")
    for i in range(40):
        est.observe("tail", 1, int(i >= 20))
    est.forget("tail")
    assert est.global_accept[0] > 0.85
    assert est.accept_rates("new")[0] == est.request_rates[0] and 0.45 < est.request_rates[0] < 0.55
    for i in range(40):
        est.observe("tail2", 1, int(i < 20))
    est.forget("tail2")
    assert est.global_accept[0] < 0.15
    assert 0.45 < est.accept_rates("newer")[0] < 0.55


def test_the_per_request_average_moves_with_the_evidence_a_request_brings():
    """Per depth, each finished request's whole-life rate; one that saw a single outcome (a request that sat at
    depth 0 and probed once) moves it a sixteenth of what one with 16 outcomes does. Requests whose drafts are
    useless bring it down within a few, and new requests with it; a depth no request reached follows the one
    above."""
    est = AcceptanceEstimates(3, 1, 4)
    est.observe("once", 1, 0)
    est.forget("once")
    assert est.request_rates[0] == pytest.approx(0.5 - 0.2 * 0.5 / 16)
    for r in range(8):
        for _ in range(16):
            est.observe(f"useless{r}", 2, 0)
        est.forget(f"useless{r}")
    assert est.accept_rates("new")[0] < 0.1
    assert est.request_seen[1:] == [0, 0] and est.prior_rates()[1:] == [est.request_rates[0]] * 2
    for _ in range(16):
        est.observe("deep", 3, 1)  # depth 1 accepted, depth 2 refused, depth 3 never reached
    est.forget("deep")
    assert est.request_seen == [10, 1, 0] and est.prior_rates()[2] == est.request_rates[1] < est.request_rates[0]
    assert est.live_attempted == [0.0] * 3  # nothing running: the average alone


def test_running_requests_pool_their_outcomes_into_the_prior():
    """A batch of 8 requests whose draft turns out useless, none finished yet: the prior (a new request's, and the
    one each of them is shrunk towards) falls with their misses, where each one's own misses alone left its
    estimate at ~0.2 against a prior of 0.5. Frozen: the prior does not move."""
    for frozen in (False, True):
        est = AcceptanceEstimates(3, 1, 4, frozen=frozen)
        for _ in range(8):
            for r in range(8):
                est.observe(f"r{r}", 2, 0)
        if frozen:
            assert est.prior_rates() == [0.5] * 3
            continue
        assert est.prior_rates()[0] < 0.2 and est.accept_rates("r0")[0] < 0.15
        est.forget("r0")
        assert est.live_attempted[0] == 56.0


def test_frozen_estimates_learn_nothing_engine_wide():
    est = AcceptanceEstimates(3, 1, 4, frozen=True)
    for _ in range(20):
        est.observe("old", 3, 3)
    est.forget("old")
    assert est.global_accept == [0.5] * 3 and est.request_rates == [0.5] * 3


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
        est.request_rates = [0.6, 0.6]  # (the engine's other requests)
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
