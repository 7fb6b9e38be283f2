"""The adaptive policy's cost model (specpd/spec/cost.py): the startup table's shape, and what online readings move."""
import pytest

from specpd.spec.cost import CostModel, PiecewiseLinear
from specpd.spec.policy import AdaptivePolicy
from tests.spec.test_policy import policy_with
from tests.spec.test_probe import epyc_like

MS = 1e-3


def test_the_cost_table_is_non_decreasing_and_extrapolates_from_its_upper_half():
    """A dense table (one point per row count, as the calibration builds it): a noisy high point at 63 rows
    must not set the slope past the table — a round over 96 rows was once priced at 8 ms, an eighth of a
    plain step at batch 8, and speculated on."""
    table = PiecewiseLinear({r: (40 + 3 * r) * MS for r in range(1, 65)})
    assert table(96) == pytest.approx((40 + 3 * 96) * MS)
    noisy = PiecewiseLinear({**{r: (40 + 3 * r) * MS for r in range(1, 64)}, 63: 0.6, 64: 0.6})
    assert noisy(96) == pytest.approx(0.6 + (0.6 - noisy(32.5)) / 31.5 * 32)  # the upper half's mean slope
    assert noisy(96) < 0.6 * 2


def test_online_readings_scale_the_table_so_a_verify_row_keeps_its_share_of_a_round():
    """Decode rounds at batch 8 read 1.5x the table (a core shared with other threads, longer contexts than the
    calibration's): the model learns that scale for every row count, so a verify row costs the same share of
    a plain round as measured and the plan's choices (extra seconds priced at the batch's tokens per second)
    do not move. An additive level did move them: a plain round read slow made verify rows look cheap. Moving
    the observed row count's point alone, as the model once did, priced rows 9-23 alike at batch 8."""
    table = {r: (40 + 2.5 * r) * MS for r in range(1, 65)}
    cost = CostModel(table, per_request=1 * MS, draft_rows={1: 3 * MS, 64: 10 * MS})
    share = (cost.target(8, 16) - cost.target(8, 8)) / cost.target(8, 8)
    real = cost.target(8, 8) * 1.5
    for _ in range(100):
        cost.observe_target(8, 8, real)
    assert cost.target(8, 8) == pytest.approx(real, rel=0.01)
    assert (cost.target(8, 16) - cost.target(8, 8)) / cost.target(8, 8) == pytest.approx(share)
    assert cost.scale == pytest.approx(1.5, rel=0.01)
    cost.observe_target(8, 8, 10.0)  # a descheduled round: its pull is bounded
    assert cost.target(8, 8) < 1.15 * real
    frozen = CostModel(table, per_request=1 * MS, draft_rows=None, frozen=True)
    frozen.observe_target(8, 8, real)
    assert frozen.scale == 1.0


def test_draft_scale_follows_what_speculating_rounds_cost_outside_the_target():
    cost = CostModel({1: 50 * MS, 64: 113 * MS}, per_request=0.5 * MS, draft_rows={1: 3 * MS, 64: 10 * MS})
    for _ in range(50):
        cost.observe_round(4, 4 * MS, False, 0.0)  # 1 ms per request outside the target at depth 0
    assert cost.off_overhead == pytest.approx(MS)
    for _ in range(100):
        cost.observe_round(4, 4 * MS + 3 * cost.draft_rows(8), True, cost.draft(8))  # 3x the measured table
    assert cost.draft_scale == pytest.approx(3.0, rel=0.05)
    cost.observe_round(4, 1.0, True, 0.0)  # a model-free drafter's round: nothing to scale
    assert cost.draft_scale == pytest.approx(3.0, rel=0.05)


def test_the_draft_prices_move_with_the_online_scale():
    """What slows the target on this core slows the draft alike: a table timed while the box was busy (every
    forward read 2x) is corrected for both by the rounds that follow, so a draft forward keeps its measured share
    of a round. The draft once kept its startup price, which only speculating rounds could correct: a decode
    server that never speculated priced its draft at 2x its share for good (issue 31)."""
    cost = CostModel({r: (40 + 2.5 * r) * MS for r in range(1, 65)}, per_request=1 * MS,
                     draft_rows={1: 3 * MS, 64: 10 * MS})
    share = cost.draft(8) / cost.target(1, 1)
    for _ in range(100):
        cost.observe_target(1, 1, cost._table(1, 1) / 2)  # the startup table read every forward 2x
    assert cost.scale == pytest.approx(0.5, rel=0.01) and cost.draft_scale == 1.0
    assert cost.draft(8) / cost.target(1, 1) == pytest.approx(share)


def test_draft_scale_learns_in_a_server_that_speculates_from_its_first_round():
    """No round at depth 0 yet (so no plain round's bookkeeping to subtract): the whole of a speculating round
    outside the target counts as the draft's, and the draft's price still follows what it costs."""
    cost = CostModel({1: 50 * MS, 64: 113 * MS}, per_request=0.5 * MS, draft_rows={1: 3 * MS, 64: 10 * MS})
    for _ in range(100):
        cost.observe_round(4, 3 * cost.draft_rows(8), True, cost.draft(8))
    assert cost.off_overhead is None and cost.draft_scale == pytest.approx(3.0, rel=0.05)


def test_with_one_thread_the_table_is_timed_in_this_threads_cpu_time():
    """A forward that waits for the core (another process's time slice; here, a sleep) reads what it computed,
    not how long it waited: with one torch thread every forward runs on the calling thread. Timed in wall time, a
    1P1D cluster's decode server calibrating while its prefill server loaded, on a shared 2-core box, got a table
    of another shape at every start (issue 31)."""
    import time

    import torch

    from specpd.spec.calibration import calibration_clock, fastest
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        name, clock = calibration_clock()
        assert name == "thread_cpu"
        t = fastest({"waits": lambda: time.sleep(0.05)}, passes=2, clock=clock)
        assert t["waits"] < 0.01
        torch.set_num_threads(2)
        assert calibration_clock()[0] == "wall"
    finally:
        torch.set_num_threads(threads)


def test_the_scale_follows_a_box_slower_than_twice_the_table():
    """One reading's pull is bounded around the scale so far (a descheduled round), not the scale itself: a box
    running every forward 3x the table is learned as 3x (it stopped at 2x once, while the draft's own correction
    followed to 3x: a draft forward then read 1.5x its share of a round)."""
    cost = CostModel({1: 50 * MS, 64: 113 * MS}, per_request=0.5 * MS, draft_rows={1: 3 * MS, 64: 10 * MS})
    for _ in range(200):
        cost.observe_target(1, 1, 3 * 50 * MS)
    assert cost.scale == pytest.approx(3.0, rel=0.01)
    for _ in range(200):
        cost.observe_target(1, 1, 50 * MS / 4)  # a table timed on a busier box than this one
    assert cost.scale == pytest.approx(0.25, rel=0.01)


def test_a_speculating_rounds_batch_wide_overhead_is_not_the_drafts_price():
    """With the draft work timed apart (draft_s), the draft's price follows that alone, and what the round
    adds beyond it and the depth-0 bookkeeping is seconds per request of the batch (round_overhead), which a
    plan that speculates at all pays."""
    cost = CostModel({1: 10 * MS, 64: 20 * MS}, 0.1 * MS, {1: MS, 64: 2 * MS})
    for _ in range(200):
        cost.observe_round(32, 32 * 0.05 * MS, False, 0.0)  # 0.05 ms per request outside the target at depth 0
    for _ in range(200):
        draft = 2 * cost.draft_rows(4)  # the draft at 2x its table
        cost.observe_round(32, draft + 32 * (0.05 + 0.1) * MS, True, cost.draft(4), speculating=1, draft_s=draft)
    assert cost.draft_scale == pytest.approx(2.0, rel=0.05)
    assert cost.round_overhead == pytest.approx(0.1 * MS, rel=0.05)
    policy = AdaptivePolicy(num_steps=2, topk=4, num_draft_tokens=5, cost=cost)
    n = 32
    base = policy._round_time([0] * n, [[1.0, 1.5, 1.8, 1.0, 1.5]] * n, [0] * n, 0, 0)
    one = policy._round_time([1] + [0] * (n - 1), [[1.0, 1.5, 1.8, 1.0, 1.5]] * n, [0] * n, 0, 0)
    assert one - base >= n * 0.1 * MS


def test_spec_scale_reads_a_speculating_round_against_measured_depth_0_rounds_of_its_batch():
    """What speculating added (a round's seconds over the depth-0 rounds of the same batch size, measured) against
    what the plan priced it at scales every price of speculating at that batch size's bucket (8-15 here), and no
    other bucket's (a lone request's stays at 1); a frozen policy learns nothing."""
    for frozen in (False, True):
        cost = CostModel({1: 10 * MS, 64: 20 * MS}, 0.1 * MS, {1: MS, 64: 2 * MS}, frozen=frozen)
        policy = AdaptivePolicy(num_steps=2, topk=4, num_draft_tokens=5, cost=cost, frozen=frozen)
        for _ in range(50):
            policy.observe_round_time(8, 20 * MS, speculated=False)
        for _ in range(200):
            policy.last_extra = (15 * MS, 5 * MS, None)  # the plan priced speculating at 5 ms over its depth-0 round
            policy.observe_round_time(8, 30 * MS, speculated=True)  # it added 10 ms over the measured 20
        assert cost.spec_scale(12) == (1.0 if frozen else pytest.approx(2.0, rel=0.05))
        assert cost.spec_scale(1) == 1.0


def test_a_lone_requests_option_is_priced_by_its_own_rounds_also_below_its_table():
    """At batch 1 a round runs one option, so its cycle reads that option's price alone, and a table that
    overprices it (a start that read 5 verify rows steep) is corrected downwards: the request speculates. The
    reading moves only that option and the bucket's scale, which stays >= 1 (options not read yet, batches of 2+
    keep it); a frozen model learns nothing."""
    for frozen in (False, True):
        cost = CostModel({1: 10 * MS, 64: 136 * MS}, 0.1 * MS, {1: MS, 64: 3 * MS}, frozen=frozen)
        policy = policy_with(cost, rate=0.25, steps=2)
        policy.frozen = frozen
        assert policy.plan(["a"]) == [(0, 1)]  # +2 ms a verify row, +1 ms the extend: depth 1 does not pay
        for _ in range(50):
            policy.observe_round_time(1, 10 * MS, speculated=False)
        for _ in range(200):
            policy.last_extra = (10 * MS, 4 * MS, 1)  # priced at 4 ms over a depth-0 round, it added 1.6
            policy.observe_round_time(1, 11.6 * MS, speculated=True)
        if frozen:
            assert cost.spec_scale(1, 1) == 1.0 and policy.plan(["a"]) == [(0, 1)]
            continue
        assert cost.spec_scale(1, 1) == pytest.approx(0.5, rel=0.05)  # 0.4x read, bounded at 0.5
        assert cost.spec_scale(1) == cost.spec_scale(1, 2) == cost.spec_scale(2, 1) == 1.0
        assert policy.plan(["a"]) == [(1, 2)]


def test_a_lone_requests_option_not_run_relaxes_towards_its_bucket():
    """An option is read only when a round runs it: one read dear in a contended stretch (1.4x) was never chosen
    again, and a lone chat request kept to narrow rounds for the rest of its reply. Each reading of another option
    moves it a step back towards the bucket's scale; the option read keeps its own reading."""
    cost = CostModel({1: 10 * MS, 64: 136 * MS}, 0.1 * MS, {1: MS, 64: 3 * MS})
    for _ in range(60):
        cost.observe_spec_extra(5.6 * MS, 4 * MS, 1, option=2)  # option 2 read at 1.4x
    dear = cost.spec_scale(1, 2)
    assert dear == pytest.approx(1.4, rel=0.02)
    for _ in range(60):
        cost.observe_spec_extra(4 * MS, 4 * MS, 1, option=-2)  # the narrow option, as priced
    bucket = cost.spec_scale(1)
    assert cost.spec_scale(1, -2) == pytest.approx(1.0, rel=0.02)
    assert 1.0 <= bucket < 1.05 and bucket < cost.spec_scale(1, 2) < 1.0 + 0.1 * (dear - 1.0)


def test_a_model_free_drafters_cost_outside_the_target_is_learned_and_priced():
    """An n-gram drafter has no draft forward; what a speculating round adds outside the target (the verify path
    for the whole batch) is measured per request of the batch and makes a marginal speculation not pay. A round
    at batch 32 with one request speculating does not make a lone request's round dear."""
    cost = CostModel({1: 50 * MS, 64: 113 * MS}, per_request=0.5 * MS, draft_rows=None)
    for _ in range(50):
        cost.observe_round(8, 8 * MS, False, 0.0)
    for _ in range(100):
        cost.observe_round(8, 8 * MS + 12 * MS, True, 0.0, speculating=2)  # 1.5 ms per request of the batch
    assert cost.round_overhead == pytest.approx(1.5 * MS, rel=0.05)
    cost.frozen = True
    ids = [f"r{i}" for i in range(8)]
    free = policy_with(CostModel({1: 50 * MS, 64: 113 * MS}, 0.5 * MS, None, frozen=True), rate=0.25, ids=ids)
    priced = policy_with(cost, rate=0.25, ids=ids)
    assert sum(k for k, _ in free.plan(ids)) > sum(k for k, _ in priced.plan(ids))
    wide = CostModel({1: 50 * MS, 64: 113 * MS}, per_request=0.5 * MS, draft_rows=None)
    for _ in range(50):
        wide.observe_round(32, 9 * MS, False, 0.0)
    for _ in range(100):
        wide.observe_round(32, 9 * MS + 18 * MS, True, 0.0, speculating=1)
    lone = AdaptivePolicy(5, 1, 6, wide)
    one, zero = (lone._round_time([k], [[1.0] * 6], [0], 0, 0) for k in (1, 0))
    assert one - zero < 3 * MS  # +1 ms a verify row, +0.6 ms the verify path's share: not 18 ms


def test_a_round_the_box_stalled_in_does_not_stop_speculation():
    """One speculating round that took 5 s (the box descheduled the server) moves each learned price by one bounded
    step (specpd.spec.cost.OUTLIER): a lone request that accepts well speculates before and after it. Unbounded, it set
    round_overhead to ~0.5 s a request, and as only a speculating round reads it again, the server never speculated
    again."""
    cost = CostModel({1: 50 * MS, 64: 113 * MS}, 0.5 * MS, {1: 3 * MS, 64: 10 * MS})
    policy = policy_with(cost, rate=0.8)
    policy.frozen = False
    for _ in range(50):
        cost.observe_round(1, 0.2 * MS, False, 0.0)
        draft = cost.draft(4)
        cost.observe_round(1, draft + 0.5 * MS, True, draft, speculating=1, draft_s=draft)
        policy.last_extra = (50 * MS, 10 * MS, 3)
        policy.observe_round_time(1, 60 * MS, speculated=True)
    before = (cost.round_overhead, cost.draft_scale, cost.spec_scale(1, 3), cost.spec_scale(1))
    assert policy.plan(["a"])[0][0] >= 2
    draft = cost.draft(4)
    cost.observe_round(1, 5.0, True, draft, speculating=1, draft_s=5.0)  # the draft "took" 5 s
    cost.observe_round(1, 5.0, True, draft, speculating=1, draft_s=draft)  # the rest of the round did
    policy.last_extra = (50 * MS, 10 * MS, 3)
    policy.observe_round_time(1, 5.0, speculated=True)
    after = (cost.round_overhead, cost.draft_scale, cost.spec_scale(1, 3), cost.spec_scale(1))
    assert after[0] < before[0] + 0.2 * MS
    assert all(a <= b * 4.0 ** 0.1 * 1.001 for a, b in zip(after[1:], before[1:])), (before, after)
    assert policy.plan(["a"])[0][0] >= 2


def test_an_extend_is_priced_by_its_own_table_and_its_scale_read_off_the_catch_ups():
    """A catch-up over a chat prompt (~150 rows) runs the draft's head on its last row only: 1.3 ms on the box
    the table comes from, where the draft table (a head on every row) read 8.5 ms, and times a draft_scale
    learned on rounds of a few rows (2.6: Python around each draft level) 26 ms. Served between target forwards
    it reads more than its warm table (2.5x on that box): each catch-up, one extend call timed alone, teaches
    `extend_scale`, and nothing else."""
    cost = epyc_like()
    cost.draft_scale, cost.scale = 2.6, 1.2
    assert cost.extend(150) == pytest.approx(1.2 * cost.extend_rows(150))
    assert cost.extend(150) < cost.draft(150) / 5 and cost.extend(0) == 0.0
    for _ in range(100):
        cost.observe_extend(150, 2.5 * 1.2 * cost.extend_rows(150))
    assert cost.extend_scale == pytest.approx(2.5, rel=0.02) and cost.draft_scale == 2.6
    assert cost.extend(40) == pytest.approx(2.5 * 1.2 * cost.extend_rows(40), rel=0.02)
    pinned = epyc_like(extend=False)  # a pinned table has none: an extend is priced as a draft forward
    assert pinned.extend(150) == pinned.draft(150)
    frozen = epyc_like()
    frozen.frozen = True
    frozen.observe_extend(150, 1.0)
    assert frozen.extend_scale == 1.0


def test_draft_scale_is_read_off_the_draft_levels_not_the_catch_up():
    """Rounds whose draft levels cost 2x their table read draft_scale 2 whatever their catch-up (2 rows or a
    300-row prompt, at any price): the catch-up's measured seconds come off the draft work first."""
    for pending in (2, 60, 300):
        cost = epyc_like()
        levels = cost.draft(4)
        for _ in range(100):
            catch = 3 * cost.extend(pending)
            cost.observe_round(1, 2 * levels + catch, True, cost.draft(4) + cost.extend(pending), 1,
                               draft_s=2 * levels + catch, predicted_extend_s=cost.extend(pending), extend_s=catch)
        assert cost.draft_scale == pytest.approx(2.0, rel=0.02), pending
        assert cost.round_overhead == pytest.approx(0.0, abs=1e-9)
