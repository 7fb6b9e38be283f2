"""Adaptive speculation: the policy's choices on synthetic cost/acceptance tables (the engine end to end:
test_spec_policy_engine.py)."""
import pytest

from specpd.spec.accept import PROBE_MIN
from specpd.spec.cost import CostModel
from specpd.spec.policy import PROBE_BUDGET, AdaptivePolicy

MS = 1e-3


def memory_bound() -> CostModel:
    """A CPU decode: 50 ms for one row, +1 ms per extra row; a 3 ms draft forward."""
    return CostModel({1: 50 * MS, 64: 113 * MS}, per_request=0.5 * MS, draft_rows={1: 3 * MS, 64: 10 * MS},
                     frozen=True)


def compute_bound() -> CostModel:
    """A saturated target: every row costs 4 ms."""
    return CostModel({1: 4 * MS, 512: 2048 * MS}, per_request=0.0, draft_rows={1: 3 * MS, 512: 100 * MS},
                     frozen=True)


def policy_with(cost: CostModel, rate: float, steps: int = 5, rounds: int = 40, ids=("a",)) -> AdaptivePolicy:
    """Every request has seen `rounds` rounds in which each depth was accepted with probability `rate`
    (fed as expected counts: accepted = round(rate * reached))."""
    policy = AdaptivePolicy(steps, 1, steps + 1, cost, frozen=True)
    for rid in ids:
        st = policy._get(rid)
        reach = 1.0
        for d in range(steps):
            st.attempted[d] = rounds * reach
            st.accepted[d] = rounds * reach * rate
            reach *= rate
    return policy


def test_useless_draft_plans_depth_zero_and_probes():
    policy = policy_with(memory_bound(), rate=0.0)
    plans = [policy.plan(["a"])[0] for _ in range(PROBE_MIN)]
    assert plans[:-1] == [(0, 1)] * (PROBE_MIN - 1)
    assert plans[-1] == (1, 2)  # the probe
    policy.observe("a", 1, 0)  # failed: the next probe waits twice as long
    assert policy._get("a").probe_every == 2 * PROBE_MIN


def test_a_shadow_probe_stays_at_depth_zero_and_learns_from_the_committed_token():
    """A drafter with a draft state probes in the shadow: its plan stays a plain step, the request is listed
    (the runner catches its draft up and compares the committed token with the draft's top-1)."""
    policy = policy_with(memory_bound(), rate=0.0)
    policy.shadow = True
    for _ in range(PROBE_MIN):
        plan = policy.plan(["a"])[0]
    assert plan == (0, 1) and policy.shadow_probes == ["a"]
    policy.observe("a", 1, 0)  # the committed token was not the draft's top-1
    assert policy._get("a").probe_every == 2 * PROBE_MIN
    assert policy.plan(["a"])[0] == (0, 1) and policy.shadow_probes == []
    for _ in range(2 * PROBE_MIN - 1):
        policy.plan(["a"])
    assert policy.shadow_probes == ["a"]
    policy.observe("a", 1, 1)  # a hit: probes at the shortest interval again, and the rate moved up
    assert policy._get("a").probe_every == PROBE_MIN and policy.accept_rates("a")[0] > 0.0


def test_a_probe_with_nothing_proposed_is_retried_not_counted_as_a_failure():
    policy = policy_with(memory_bound(), rate=0.0)
    for _ in range(PROBE_MIN):
        plan = policy.plan(["a"])[0]
    assert plan == (1, 2)
    policy.observe("a", 0, 0)  # an n-gram drafter found no match: the tree was the root alone
    assert policy._get("a").probe_every == PROBE_MIN
    assert policy.plan(["a"])[0] == (1, 2)  # probes again at once


def test_good_draft_speculates_deep_and_a_mediocre_one_shallower():
    deep = policy_with(memory_bound(), rate=0.9).plan(["a"])[0]
    assert deep == (5, 6)
    mid = policy_with(memory_bound(), rate=0.4).plan(["a"])[0]
    assert 1 <= mid[0] < 5


def test_compute_bound_batches_speculate_less():
    ids = [f"r{i}" for i in range(16)]
    cheap = policy_with(memory_bound(), rate=0.5, ids=ids).plan(ids)
    saturated = policy_with(compute_bound(), rate=0.5, ids=ids).plan(ids)
    assert all(k >= 1 for k, _ in cheap)
    assert sum(k for k, _ in saturated) < sum(k for k, _ in cheap)
    assert all(k == 0 for k, _ in policy_with(compute_bound(), rate=0.3, ids=ids).plan(ids))


def test_per_request_depths_differ_by_acceptance():
    policy = policy_with(memory_bound(), rate=0.9, ids=["good"])
    st = policy._get("bad")
    st.attempted[0], st.accepted[0] = 40.0, 0.0
    plans = dict(zip(["good", "bad"], policy.plan(["good", "bad"])))
    assert plans["good"][0] >= 3 and plans["bad"][0] == 0


def test_verify_rows_are_priced_exactly_across_a_cost_step():
    """The CPU kernel's cost steps at 9 rows (a second row block): at batch 8 the first extra row costs 10 ms,
    the next ones 0.5 ms each. A request that accepts nearly everything pays the step once and goes deep;
    pricing every row at the first one's cost would keep it at depth 0."""
    table = {r: (50 + 0.5 * r + (10 if r > 8 else 0)) * MS for r in range(1, 65)}
    ids = [f"r{i}" for i in range(8)]
    policy = policy_with(CostModel(table, per_request=0.0, draft_rows=None, frozen=True), rate=0.0, ids=ids[1:])
    good = policy._get("r0")
    reach = 1.0
    for d in range(5):
        good.attempted[d], good.accepted[d] = 40 * reach, 40 * reach * 0.95
        reach *= 0.95
    plans = policy.plan(ids)
    assert plans[0][0] >= 4 and all(k == 0 for k, _ in plans[1:]), plans


def test_a_wide_tree_that_crosses_a_cost_step_goes_narrow():
    """EAGLE-3's K=4 tree adds 4 verify rows a request even at depth 1: at batch 3 that crosses the CPU
    kernel's 6 -> 8-row step (this box's table), while the top path alone (one row a request) stays below it.
    With the top path accepted nearly as often as the tree, the plan verifies it narrow; at batch 1, where
    rows are cheap, the same request drafts its full width."""
    table = {r: (44 + 0.6 * r + (10 if r > 6 else 0) + (1.5 * (r - 8) if r > 8 else 0)) * MS for r in range(1, 65)}
    cost = CostModel(table, per_request=1 * MS, draft_rows={1: 3 * MS, 64: 20 * MS}, frozen=True)
    ids = ["a", "b", "c"]
    policy = AdaptivePolicy(2, 4, 5, cost, frozen=True)
    for rid in ids:
        st = policy._get(rid)
        st.attempted[:], st.accepted[:] = [40.0, 28.0], [28.0, 16.0]  # the tree: 0.7, then 0.57
        st.chain_attempted[:], st.chain_accepted[:] = [40.0, 24.0], [24.0, 12.0]  # its top path: 0.6, 0.5
    plans = policy.plan(ids)
    assert all(k >= 1 and budget == k + 1 for k, budget in plans), plans
    (k, budget), = policy.plan(["a"])
    assert k >= 1 and budget == policy.rows(k) == 5


def test_every_verify_teaches_the_narrow_shape_from_its_top_path():
    """A full-width round's accepted path, cut where a node was not its parent's top-ranked child, is what a
    narrow round would have kept; a narrow round's own outcome teaches the narrow shape only."""
    import torch

    from specpd.spec.runner import top_path_length
    from specpd.spec.tree import DraftTree
    # root -> 1 (best), 2; 1 -> 3, 4 (best); 2 -> 5
    tree = DraftTree(torch.tensor([9, 10, 11, 12, 13, 14]), torch.tensor([-1, 0, 0, 1, 1, 2]),
                     torch.tensor([0, 1, 1, 2, 2, 2]), torch.tensor([0.0, -0.1, -2.0, -1.5, -0.5, -2.5]))
    assert top_path_length(tree, [1, 4]) == 2
    assert top_path_length(tree, [1, 3]) == 1
    assert top_path_length(tree, [2, 5]) == 0
    assert top_path_length(tree, []) == 0
    policy = AdaptivePolicy(2, 4, 5, memory_bound(), frozen=True)
    policy.observe("a", 2, 2, top_path=1)  # the tree kept 2; its top path would have kept 1
    st = policy._get("a")
    assert st.attempted == [1.0, 1.0] and st.accepted == [1.0, 1.0]
    assert st.chain_attempted == [1.0, 1.0] and st.chain_accepted == [1.0, 0.0]
    policy._narrow["a"] = True  # the last plan drafted narrow
    policy.observe("a", 2, 0, top_path=0)
    assert st.attempted == [1.0, 1.0]  # the tree's statistics untouched
    assert st.chain_attempted == [0.9 + 1.0, 0.9] and st.chain_accepted == [0.9, 0.0]


def test_the_narrow_prior_is_the_requests_own_rate_times_the_paired_top_path_share():
    """A request's narrow estimate starts from its own full-width rate times how often the top path keeps what
    the tree keeps, engine-wide, read off the same full-width rounds (pairs). Narrow rounds' own outcomes and
    shadow probes (a top-1 test, no tree) leave the share alone: the requests that chose narrow are the ones
    accepting most, and an engine-wide narrow rate learned on them once led a batch of 8 to speculate where
    the top path failed."""
    policy = AdaptivePolicy(2, 4, 5, memory_bound())  # not frozen: engine-wide learning on
    assert policy.top_path_share() == pytest.approx([0.75, 0.75])  # the prior before any pair
    for i in range(60):  # full-width rounds: the tree keeps 2 every round, its top path 2 in every other, else 1
        policy.observe("a", 2, 2, top_path=1 + i % 2)
    share = policy.top_path_share()
    assert share[0] == pytest.approx(1.0, abs=0.02) and share[1] == pytest.approx(0.5, abs=0.1)
    for _ in range(60):  # narrow rounds that always keep everything, and shadow probes that always hit
        policy._narrow["b"] = True
        policy.observe("b", 2, 2, top_path=2)
        policy._narrow["b"] = False
        policy.observe("c", 1, 1, top_path=1, shadow=True)
    assert policy.top_path_share() == pytest.approx(share)
    # a fresh request: its narrow prior is its full-width estimate scaled by the share, depth by depth
    wide, narrow = policy.accept_rates("d"), policy.accept_rates("d", narrow=True)
    assert narrow[0] == pytest.approx(wide[0] * share[0]) and narrow[1] == pytest.approx(wide[1] * share[1])
    assert narrow[1] < wide[1]


def test_a_measured_tree_factor_makes_verify_rows_dearer():
    """Batches whose requests each verify several rows cost more than one request's rows in the table
    (CostModel.tree_factor, measured at startup): with it at 2 the same acceptance buys less depth."""
    ids = [f"r{i}" for i in range(8)]

    def depth(factor):
        cost = CostModel({1: 50 * MS, 64: 113 * MS}, 0.5 * MS, None, frozen=True, tree_factor=factor)
        return sum(k for k, _ in policy_with(cost, rate=0.45, ids=ids).plan(ids))
    assert depth(1.0) > depth(2.0)


@pytest.mark.parametrize("shadow", [False, True])
def test_probes_stay_within_the_engine_wide_budget_at_large_batches(shadow):
    """16 requests with a useless draft: on their own schedules nearly every round would hold a probe;
    the budget keeps the probes' modelled cost within PROBE_BUDGET of the modelled time (+ what it saved);
    a shadow probe costs its catch-up extend only, so more of them fit."""
    ids = [f"r{i}" for i in range(16)]
    policy = policy_with(memory_bound(), rate=0.0, ids=ids)
    policy.frozen = False  # the budget is off when frozen
    policy.shadow = shadow
    spent = total = 0.0
    probes = 0
    for _ in range(400):
        before = policy.probe_credit
        plans = policy.plan(ids)
        base = policy._round_time([0] * 16, [[1.0] * 6] * 16, [0] * 16, 0, 0)
        total += base
        spent += max(0.0, before + PROBE_BUDGET * base - policy.probe_credit)
        for rid, (k, _) in zip(ids, plans):
            if k or rid in policy.shadow_probes:
                assert not (k and shadow)
                probes += 1
                policy.observe(rid, 1, 0)
    assert probes > 0
    assert spent <= PROBE_BUDGET * total * 1.01
    assert probes < 16 * 400 / PROBE_MIN / 4  # far fewer than the per-request schedules alone


@pytest.mark.parametrize("batch", [1, 4, 8])
def test_a_box_slowed_alike_for_target_and_draft_plans_the_same_rounds(batch):
    """A decode server whose core is shared (under PD: its HTTP and transfer threads, the router) runs every
    forward 2x slower than its startup table: the plan must not change, since what a round buys and what it
    costs moved alike. Under an additive per-request level the slow plain round made verify rows look cheap
    and D speculated where it lost (PD TPOT above non-spec). The online scale moves the draft's prices too: it
    once moved the target's alone, and a table timed on a busy box (every forward 2x) then priced the draft at
    2x the target's share for good (issue 31)."""
    ids = [f"r{i}" for i in range(batch)]
    for rate in (0.2, 0.35, 0.5, 0.65, 0.8):
        for factor in (0.5, 2.0):
            fast = policy_with(memory_bound(), rate=rate, ids=ids)
            slow = policy_with(memory_bound(), rate=rate, ids=ids)
            slow.cost.scale = factor  # what observe_target learns: nothing else moves
            assert slow.plan(ids) == fast.plan(ids), (rate, factor)


def test_deferred_catch_up_counts_against_speculating():
    """A request whose draft extend is far behind pays a long catch-up to speculate: a marginal depth that
    pays with nothing deferred does not with 200 tokens deferred (the draft table grows past 64 rows)."""
    policy = policy_with(memory_bound(), rate=0.3)
    assert policy.plan(["a"], pending=[0])[0][0] >= 1
    assert policy.plan(["a"], pending=[200])[0][0] == 0


def test_a_deferred_prompt_is_charged_to_no_decision_but_a_probe_pays_it():
    """A deferred prompt extend (`unpriced`, paid at prefill when eager) is charged to no decision, 200 decode
    tokens are; a request with it waiting is not in step: its shadow probe waits for its interval and for the
    budget to save up the whole catch-up, which it then pays (nothing else would run it: specpd/spec/defer.py)."""
    policy = policy_with(memory_bound(), rate=0.3)
    assert policy.plan(["a"], pending=[0], unpriced=[200])[0][0] >= 1
    assert policy.plan(["a"], pending=[200], unpriced=[0])[0][0] == 0
    for credit, probes in ((0.9, False), (1.01, True)):  # x the whole catch-up's price
        useless = policy_with(memory_bound(), rate=0.0)
        useless.shadow, useless.frozen = True, False
        due = useless._get("a").probe_every
        plans = [(useless.plan(["a"], pending=[0], unpriced=[200]), useless.shadow_probes) for _ in range(due - 1)]
        assert [p[1] for p in plans] == [[]] * (due - 1)
        useless.probe_credit = credit * useless.cost.draft(201)  # (saving it up is not what is checked)
        useless.plan(["a"], pending=[0], unpriced=[200])
        assert useless.shadow_probes == (["a"] if probes else []), credit  # in step it would probe for free
    pinned = policy_with(memory_bound(), rate=0.0)  # catch-ups priced as work moved earlier: one draft forward
    pinned.shadow, pinned.frozen, pinned.catch_up_settled = True, False, True
    assert pinned._catch_up_cost(0, 200) == pinned.cost.draft(1) < useless._catch_up_cost(0, 200)


def test_observe_updates_conditional_rates():
    policy = AdaptivePolicy(3, 1, 4, memory_bound(), frozen=True)
    for _ in range(30):
        policy.observe("a", 3, 1)  # depth 1 always accepted, depth 2 always refused
    rates = policy.accept_rates("a")
    assert rates[0] > 0.8 and rates[1] < 0.3  # ~10 rounds of memory against 4 of prior
    assert rates[2] == pytest.approx(rates[1])  # depth 3 never reached: it follows depth 2 (flat prior trend)


def test_a_request_that_keeps_accepting_is_expected_to_keep_accepting_deeper():
    policy = AdaptivePolicy(6, 1, 7, memory_bound(), frozen=True)
    policy.request_rates = [0.2] * 6  # the engine has seen a weak draft
    for _ in range(6):
        policy.observe("copy", 2, 2)  # a copied span: everything it tried was accepted
    rates = policy.accept_rates("copy")
    assert rates[2] > 0.6 and rates[5] > 0.5  # untried depths follow the request, not the weak engine
    assert policy.plan(["copy"])[0][0] >= 4


# -- in the engine ----------------------------------------------------------------------------
@pytest.mark.parametrize("shadow,frozen", [(False, True), (True, True), (True, False)])
def test_the_idle_shortcut_plans_what_the_full_search_plans(shadow, frozen, monkeypatch):
    """While every request sits at depth 0 the policy skips its search (nothing it reads moved, catch-ups only
    grew): round by round, through probes, outcomes, a request leaving and one arriving, a batch of useless
    drafts and good ones must get exactly the plans (and probes) of a policy that searches every round."""
    import random
    rng = random.Random(0)

    def make() -> AdaptivePolicy:
        cost = memory_bound()
        cost.frozen = frozen
        policy = AdaptivePolicy(3, 2, 6, cost, frozen=frozen, shadow=shadow)
        for rid, rate in (("u0", 0.0), ("u1", 0.0), ("u2", 0.05), ("g", 0.95)):
            st = policy._get(rid)
            for d in range(3):
                st.attempted[d], st.accepted[d] = 20.0, 20.0 * rate
        return policy

    fast, full = make(), make()
    full._idle_holds = lambda key, pending: False
    ids, pending, shortcuts, woke = ["u0", "u1", "u2"], [0, 0, 0], 0, 0
    for rnd in range(300):
        if rnd == 150:  # a request finishes, a good one arrives
            for p in (fast, full):
                p.release("u1")
            ids, pending = ["u0", "u2", "g"], [pending[0], pending[2], 0]
        key = (tuple(ids), 0, 0, fast._observed, fast.cost.spec_readings)
        shortcuts += fast._idle_holds(key, pending)
        plans = fast.plan(ids, 0, 0, pending)
        assert plans == full.plan(ids, 0, 0, pending), rnd
        woke += rnd < 150 and plans[ids.index("u2")][0] > 0
        assert fast.shadow_probes == full.shadow_probes and fast.last_draft_s == full.last_draft_s, rnd
        probes = set(fast.shadow_probes)
        for i, (rid, (steps, _)) in enumerate(zip(ids, plans)):
            if steps > 0 or rid in probes:
                # u2's text turns copyable at round 60: its probes start to hit, and it must start speculating
                rate = 0.9 if rid == "g" or (rid == "u2" and rnd >= 60) else 0.02
                depth, hit = max(steps, 1), rng.random() < rate
                for p in (fast, full):
                    p.observe(rid, depth, int(hit), top_path=int(hit), shadow=rid in probes)
                pending[i] = 1  # caught up; the round's own token is deferred (SpecRunner)
            else:
                for p in (fast, full):
                    p.observe(rid, 0, 0)
                pending[i] += 1
    # the shortcut was taken in many rounds of the useless batch (fewer with shadow probes, which recur every
    # SHADOW_PROBE_MAX rounds at most)
    assert shortcuts > 60
    assert woke > 0 or not frozen  # and it let go once u2's probes kept hitting (unfrozen: the budget spaces them)


def test_a_request_whose_draft_is_in_step_shadow_probes_for_free():
    """Its first round (the prefill's draft extend, or under PD the handoff's, left nothing deferred): whether
    the committed token is the draft's top-1 costs nothing to learn, so it is learned whatever the budget
    holds, and a request at depth 0 from its first round still teaches the engine-wide estimate."""
    policy = policy_with(memory_bound(), rate=0.0, ids=["a", "b"])
    policy.frozen, policy.shadow = False, True
    assert policy.plan(["a", "b"], pending=[0, 3]) == [(0, 1), (0, 1)]
    assert policy.shadow_probes == ["a"] and policy.probe_credit == pytest.approx(
        PROBE_BUDGET * policy._round_time([0, 0], [[1.0] * 6] * 2, [0, 0], 0, 0))


@pytest.mark.parametrize("settled", [True, False])
def test_settled_catch_ups_are_not_charged(settled):
    """Where the engine runs a finishing request's deferred extends anyway (the prefix cache keeps draft KV
    valid), speculating again moves that work earlier: a depth that pays with nothing deferred pays with 200
    tokens deferred. Otherwise the catch-up is what speculating costs (test_deferred_catch_up_counts_...)."""
    policy = policy_with(memory_bound(), rate=0.3)
    policy.catch_up_settled = settled
    assert policy.plan(["a"], pending=[0])[0][0] >= 1
    assert (policy.plan(["a"], pending=[200])[0][0] >= 1) == settled


def test_a_request_at_depth_zero_keeps_probing_while_its_catch_up_grows():
    """Its catch-up grows a token a round while it sits at depth 0. Charged in full, a shadow probe outgrew the
    budget (0.5% of a 47 ms round saved per round against ~0.3 ms a draft row, a busy box's startup reading) and
    the request never probed again: the first plans at depth 0 held for good, and the engine-wide acceptance
    stayed the prior (a decode server that never speculated, issue 31). Settled catch-ups cost a probe one
    draft forward."""
    cost = CostModel({1: 47 * MS, 64: 113 * MS}, per_request=0.5 * MS, draft_rows={1: 3 * MS, 64: 23 * MS})
    for settled, expect_probes in ((False, False), (True, True)):
        policy = AdaptivePolicy(3, 2, 6, cost, shadow=True, catch_up_settled=settled)
        for d in range(3):  # the request's draft looks useless so far, and the engine's: it stays at depth 0
            st = policy._get("a")
            st.attempted[d], st.accepted[d] = 20.0, 0.0
        policy.request_rates = [0.0] * 3
        pending, probes = 1, 0
        for _ in range(600):
            assert policy.plan(["a"], pending=[pending]) == [(0, 1)]
            if policy.shadow_probes:
                probes += 1
                policy.observe("a", 1, 0, top_path=0, shadow=True)
            else:
                policy.observe("a", 0, 0)
            pending = 1 if policy.shadow_probes else pending + 1
        assert (probes >= 4) == expect_probes, (settled, probes)  # failing probes: every 8, 16, .. 128 rounds


def test_a_released_request_id_does_not_inherit_the_idle_plan():
    """The idle shortcut's key names the batch's request ids: a new request under a finished one's id (an
    offline caller, a test harness) must be searched afresh, not handed the old one's depth 0."""
    policy = policy_with(memory_bound(), rate=0.0)
    assert policy.plan(["a"]) == [(0, 1)] and policy._idle is not None
    policy.release("a")
    st = policy._get("a")
    for d in range(5):
        st.attempted[d], st.accepted[d] = 40.0, 36.0
    assert policy.plan(["a"])[0][0] >= 1
