"""Probes (specpd/spec/policy.py 4): a probe dearer than what the budget saves over PROBE_CREDIT_ROUNDS rounds is still
taken in time (the budget saves up to its price), and the whole stays within PROBE_BUDGET; a shadow probe's outcome
is what the tree it stands for would have kept; a lone request that began at depth 0 with its prompt's extend deferred
probes within its reply (the catch-up priced as an extend runs: CostModel.extend)."""
from types import SimpleNamespace

import pytest

from specpd.spec.draft.proposer import DraftState
from specpd.spec.cost import CostModel
from specpd.spec.policy import PROBE_BUDGET, PROBE_CREDIT_ROUNDS, AdaptivePolicy
from specpd.spec.runner import SpecRunner

MS = 1e-3


def epyc_like(extend: bool = True) -> CostModel:
    """The startup table an AVX512-BF16 EPYC measured (2 threads, bf16): a target step of 8.5 ms, a draft forward
    with its head on every row, and (`extend`) a draft extend with its head on the last row alone."""
    return CostModel({1: 8.5 * MS, 5: 9.8 * MS, 8: 11.1 * MS, 64: 53.8 * MS}, per_request=0.2 * MS,
                     draft_rows={1: 0.44 * MS, 16: 1.13 * MS, 64: 4.1 * MS},
                     extend_rows={1: 0.42 * MS, 16: 0.49 * MS, 64: 0.9 * MS} if extend else None)


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


@pytest.mark.parametrize("num_draft_tokens,kept", [(5, True), (3, False)])
def test_a_shadow_probe_counts_what_the_trees_first_level_keeps(num_draft_tokens, kept):
    """The committed token third in the draft's top-4: a full-width tree keeps min(K, T - 1) first-level nodes, so
    with T = 5 it is accepted at depth 1 (with T = 3 it is not); a narrow round keeps the top-1 only. Counted as the
    top-1 (as before), the chat workload's depth-1 acceptance read ~0.2 against the tree's ~0.6, and a served c1
    server that once stopped speculating never started again (issue 32)."""
    cost = CostModel({1: 10 * MS, 64: 100 * MS}, per_request=0.0, draft_rows={1: 1 * MS, 64: 10 * MS})
    policy = AdaptivePolicy(2, 4, num_draft_tokens, cost, shadow=True)
    runner = SimpleNamespace(policy=policy, _guesses={})
    request = SimpleNamespace(request_id="a", spec_state=DraftState([7, 8, 9, 10], [0.4, 0.3, 0.2, 0.1], None))
    policy._get("a").probing = True
    SpecRunner._observe_shadow(runner, request, [9, 3])
    st = policy._get("a")
    assert (st.accepted[0], st.attempted[0]) == (float(kept), 1.0)
    assert (st.chain_accepted[0], st.chain_attempted[0]) == (0.0, 1.0)  # the narrow shape's top-1 missed
    SpecRunner._observe_shadow(runner, request, [7])  # the top-1: both shapes keep it
    assert st.chain_accepted[0] == pytest.approx(1.0) and st.accepted[0] == pytest.approx(0.9 * kept + 1.0)


def test_a_shadow_probes_interval_stops_doubling_at_its_own_cap():
    """A shadow probe costs no verify row (its catch-up draws on the probe budget): its interval doubles on a miss up
    to SHADOW_PROBE_MAX rounds, a verify probe's up to PROBE_MAX (issue 32: a c1 server whose first replies accepted
    little probed about once a reply and stayed at depth 0)."""
    from specpd.spec.accept import PROBE_MAX, SHADOW_PROBE_MAX
    cost = CostModel({1: 10 * MS, 64: 100 * MS}, per_request=0.0, draft_rows={1: 1 * MS, 64: 10 * MS})
    policy = AdaptivePolicy(2, 4, 5, cost, shadow=True)
    for shadow, cap in ((True, SHADOW_PROBE_MAX), (False, PROBE_MAX)):
        st = policy._get(f"r{shadow}")
        for _ in range(8):
            st.probing = True
            policy.observe(f"r{shadow}", 1, 0, top_path=0, shadow=shadow)
        assert st.probe_every == cap
        st.probing = True
        policy.observe(f"r{shadow}", 1, 1, top_path=1, shadow=shadow)  # a hit: back to the shortest interval
        assert st.probe_every == 8
    assert SHADOW_PROBE_MAX < PROBE_MAX


def test_a_lone_request_that_began_at_depth_0_probes_within_its_reply():
    """A chat request whose prior said depth 0 (the engine-wide rate fell on the last replies' misses), its prompt's
    extend deferred (150 rows): its first shadow probe catches the draft up over the prompt, paid from the probe
    budget. Priced as a draft extend runs (the head on the last row), the budget covers it within a 96-token reply;
    priced with the head on every row and times draft_scale (2.6), it took ~500 rounds, and a c1 server whose
    prior had fallen decoded every later reply plainly (0.86x plain on an AVX512-BF16 EPYC, where a fixed
    depth read 1.18x)."""
    first = {}
    for extend in (True, False):
        policy = AdaptivePolicy(4, 4, 5, epyc_like(extend), shadow=True)
        policy.cost.draft_scale = 2.6
        policy.request_rates = [0.1] * 4
        for n in range(96):
            plan = policy.plan(["a"], pending=[n], unpriced=[150])
            assert plan == [(0, 1)]
            if policy.shadow_probes:
                first[extend] = n
                break
    assert first.get(True, 96) < 96 <= first.get(False, 96)
