"""The adaptive policy's cost model (spec_cost.py): the startup table's shape, and what online readings move."""
import pytest

from specpd.engine.spec_cost import CostModel, PiecewiseLinear

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
