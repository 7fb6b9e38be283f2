"""The probe budget (spec_policy.py 4): a probe dearer than what the budget saves over PROBE_CREDIT_ROUNDS rounds
is still taken in time (the budget saves up to its price), and the whole stays within PROBE_BUDGET."""
from specpd.engine.spec_cost import CostModel
from specpd.engine.spec_policy import PROBE_BUDGET, PROBE_CREDIT_ROUNDS, AdaptivePolicy

MS = 1e-3


def test_a_probe_dearer_than_the_saved_budget_is_taken_in_time():
    """A lone request with a draft that has not accepted yet, whose depth-1 round costs 10 ms over a 10 ms plain
    one: PROBE_CREDIT_ROUNDS rounds of budget are 3.2 ms, so under a fixed cap it never probed (after a c32 run
    raised spec_scale, a grounded n-gram request at tau ~4 decoded plainly for its whole life)."""
    cost = CostModel({1: 10 * MS, 2: 20 * MS, 64: 100 * MS}, per_request=0.0, draft_rows=None)
    policy = AdaptivePolicy(3, 1, 4, cost)  # model-free (n-gram): a probe is a depth-1 verify round
    st = policy._get("a")
    st.attempted[0], st.accepted[0] = 40.0, 0.0
    probe_price = policy._round_time([1], [[1.0] * 4], [0], 0, 0) - policy._round_time([0], [[1.0] * 4], [0], 0, 0)
    assert probe_price > PROBE_BUDGET * PROBE_CREDIT_ROUNDS * 10 * MS
    probes, rounds, spent = 0, 1000, 0.0
    for _ in range(rounds):
        if policy.plan(["a"])[0][0]:
            probes += 1
            spent += probe_price
            policy.observe("a", 1, 0)  # it failed: the next one waits longer, and for the budget
    assert probes >= 2
    assert spent <= PROBE_BUDGET * rounds * 10 * MS + probe_price  # the budget, and what it saved up
