"""The adaptive policy's cost model (policy.py): seconds of one target forward by (requests, rows) and of
one draft forward by rows, measured at startup (calibration.calibrate) and corrected online: every decode
round's timing scales the whole table, target and draft alike (`CostModel.scale`), so a verify row and a draft
forward keep their measured shares of a round, and what speculating rounds cost outside the target forward
beyond that scales the draft's prices further (`CostModel.draft_scale`). A draft extend (a catch-up, a round's
extend) has a table of its own: it runs the draft's head on each request's last row only, so its rows cost a
layer's KV writes, not a head each (`CostModel.extend`), and its online scale is read off the catch-ups, each one
extend call timed alone (`CostModel.extend_scale`)."""
from __future__ import annotations

import bisect

ONLINE_RATE = 0.1  # cost-model EMA step per measured forward
DRAFT_SCALE_RANGE = (0.5, 8.0)
SPEC_SCALE_RANGE = (1.0, 8.0)  # spec_scale only raises the prices: read off a round's execute alone (before its
# cycle was), it could fall below 1, and a batch priced so speculated in nearly every round and lost to plain
SPEC_SCALE_BUCKETS = (1, 2, 4, 8, 16)  # spec_scale is learned per batch size bucket (the largest of these <= it)
# a lone request's rounds read spec_scale per option (depth and width) and both ways: `CostModel.spec_scale`
OPTION_SCALE_RANGE = (0.5, 8.0)
# and an option not run relaxes towards its bucket's scale by this step (log space) each time another is read: an
# option is read only when run, so one read dear in a contended stretch of a shared machine was never chosen again,
# and a lone chat request sat on narrow rounds for the rest of its reply, behind the full tree every round (the
# adaptive policy against a fixed shape: evals/spec_round_cost.py, evals/results/spec_round_cost.json)
OPTION_RELAX = 0.05
EXTEND_SCALE_RANGE = (0.5, 8.0)
# one round's reading moves a learned price by at most a step towards OUTLIER x (or 1 / OUTLIER x) it, plus
# OUTLIER_FLOOR_S for an additive one: a round the machine stalled for seconds (a shared VM does) would otherwise
# set `round_overhead` to a price no speculating round pays back, and as only a speculating round reads it again,
# that server would never speculate again, at any concurrency
OUTLIER = 4.0
OUTLIER_FLOOR_S = 1e-3
SCALE_READING = (0.5, 2.0)  # one decode round's reading of `CostModel.scale`, relative to the scale so far, is
# bounded (a descheduled round reads several times its cost); the scale itself follows the box however far


def spec_bucket(requests: int) -> int:
    """The SPEC_SCALE_BUCKETS entry a batch of `requests` falls in."""
    return SPEC_SCALE_BUCKETS[max(0, bisect.bisect_right(SPEC_SCALE_BUCKETS, requests) - 1)]


class PiecewiseLinear:
    """y(x) through measured points (x ascending), non-decreasing (more rows never cost less); beyond the
    last point, linear at the mean slope of the upper half (the last two points of a dense table are one
    row apart, and one noisy reading there would set the slope of everything past the table)."""

    def __init__(self, points: dict[int, float]):
        if not points:
            raise ValueError("a cost table needs at least one measured point")
        self.xs = sorted(points)
        self.ys = [float(points[x]) for x in self.xs]
        self._slope = 0.0  # past the last point
        if len(self.xs) > 1:
            half = (self.xs[-1] - self.xs[0]) / 2
            self._slope = max(0.0, (self.ys[-1] - self._inside(self.xs[0] + half)) / half)
        self._memo: dict[float, float] = {}  # the policy prices the same few row counts many times a round

    def __call__(self, x: float) -> float:
        y = self._memo.get(x)
        if y is None:
            if len(self._memo) > 4096:
                self._memo.clear()
            y = self._memo[x] = self._eval(x)
        return y

    def _eval(self, x: float) -> float:
        xs, ys = self.xs, self.ys
        if len(xs) == 1:
            return ys[0] * max(x, 1) / max(xs[0], 1)
        if x > xs[-1]:
            return ys[-1] + self._slope * (x - xs[-1])
        return self._inside(x)

    def _inside(self, x: float) -> float:
        xs, ys = self.xs, self.ys
        i = min(max(bisect.bisect_left(xs, x), 1), len(xs) - 1)
        x0, x1, y0, y1 = xs[i - 1], xs[i], ys[i - 1], ys[i]
        return max(0.0, y0 + (y1 - y0) * (x - x0) / (x1 - x0))


class CostModel:
    """target(requests, rows) and draft(rows) in seconds; draft_step_overhead: Python per draft level."""

    def __init__(self, target_rows: dict[int, float], per_request: float, draft_rows: dict[int, float] | None,
                 frozen: bool = False, tree_factor: float = 1.0, clock: str = "wall",
                 extend_rows: dict[int, float] | None = None):
        self.target_rows = PiecewiseLinear(target_rows)  # one request with `rows` query rows
        self.per_request = per_request  # extra seconds per further request in the batch
        # measured / modelled seconds of a batch whose requests each verify several rows (their attention runs
        # as padded multi-row blocks with tree masks, which one request's rows do not show): verify rows cost
        # this much more than the table says
        self.tree_factor = tree_factor
        self.draft_rows = PiecewiseLinear(draft_rows) if draft_rows else None  # None: model-free drafter
        # one draft extend over `rows` rows of one request (the head on its last row alone); None: extends are
        # priced as draft forwards (a pinned table). Priced with the head on every row, as a draft level runs, a
        # prompt's catch-up (every prompt row) read several times what it runs in, and more again times
        # draft_scale (learned on rounds of a few rows): a shadow probe the budget saved up for over most of a
        # reply, so a lone request that began at depth 0 never probed in its reply
        self.extend_rows = PiecewiseLinear(extend_rows) if extend_rows and draft_rows else None
        # measured / priced seconds of a catch-up (one extend call, timed alone: `observe_extend`), on top of the
        # online scale: served, between target forwards, an extend runs well above its warm table (the draft's
        # weights and the request's KV come from memory, not cache), and probes priced at the table overspent
        # their budget (policy.PROBE_BUDGET)
        self.extend_scale = 1.0
        self.frozen = frozen
        self.clock = clock  # what the startup table was timed with: "thread_cpu" or "wall" (calibration.py)
        # measured / tabled seconds of a decode round's target forward (longer contexts than the calibration's,
        # the box's drift, a core shared with a prefill server), learned online and applied to every row count:
        # what slows a forward on a shared CPU (time slices, memory bandwidth, attention over a longer context)
        # slows its every row alike. Not an additive level per request: under PD a decode server's forwards run
        # well above the table, and such a level made a plain round look slow and so a verify row cheap against
        # it, and the policy speculated where it lost. Not the observed row count's point alone: that left the
        # rows past it at one price, verify rows for free. The draft's prices move with it: the same core runs
        # both. Apart, a table timed while the machine was busy left a decode server that never speculated
        # pricing its draft high for good (draft_scale learns only from speculating rounds), its probes and
        # rounds never paying.
        self.scale = 1.0
        # measured / predicted seconds of what a speculating round adds outside the target forward, the
        # prediction already at the online scale: the draft's own drift from its share of the table (Python
        # around it, trees, verify)
        self.draft_scale = 1.0
        self.off_overhead = None  # seconds per request outside the target forward of a round at depth 0
        # seconds per request (every request of the batch, at any depth) that a round in which any request
        # speculates adds outside its draft work and the depth-0 bookkeeping: the verify path (trees, verify,
        # commit) runs for the whole batch. It grows with the batch, not with the draft's rows: charged to the
        # draft's price (draft_scale), a large batch read its draft far above the table and still took rounds where
        # one request speculated and the round cost more than a plain one (evals/peers.py at its highest
        # concurrency, evals/results/peers.json)
        self.round_overhead = 0.0
        # measured / priced seconds that speculating adds to a round, over all the parts above (policy.py, 5b), per
        # batch-size bucket: a large batch's speculating round runs well above its price (prefill interplay, a
        # whole batch's verify bookkeeping), and one engine-wide scale then priced a lone request's rounds so
        # dear that a grounded n-gram request, its drafts nearly always accepted, never speculated after a large
        # batch had run
        self._spec_scales: dict[int, float] = {}
        # the same for a lone request, per option (depth k full width, -k narrow), and both ways: one round runs
        # one option, so its cycle reads that option's price alone. The startup table's shape (what a full tree's
        # verify rows cost over one row) differs process to process on one machine, each start stable, and a start
        # that reads it steep prices a full round above its cycle, which a scale kept >= 1 never corrects: such a
        # server sat at depth 0 through most of a lone chat request's rounds (issue 32)
        self._option_scales: dict[int, float] = {}
        self.spec_readings = 0  # speculating rounds read into spec_scale (the policy's idle shortcut keys on it)

    @classmethod
    def pinned(cls, with_draft: bool) -> "CostModel":
        """A fixed table in the shape this engine measures on CPU (50 ms a decode step, +1 ms a row,
        3 ms a draft forward), for tests that need reproducible plans."""
        return cls({1: 0.050, 64: 0.113}, 0.0005, {1: 0.003, 64: 0.010} if with_draft else None, frozen=True)

    def spec_scale(self, requests: int, option: int | None = None) -> float:
        """What speculating costs over its price in a round of `requests` requests (1.0 until a speculating round
        of its bucket was read); a lone request's `option`, once read, by its own reading."""
        bucket = self._spec_scales.get(spec_bucket(requests), 1.0)
        if requests == 1 and option is not None:
            return self._option_scales.get(option, bucket)
        return bucket

    def target(self, requests: int, rows: int) -> float:
        return self._table(requests, rows) * self.scale

    def _table(self, requests: int, rows: int) -> float:
        """The startup measurement's price, without the online scale."""
        return self.target_rows(rows) + self.per_request * max(requests - 1, 0)

    def draft(self, rows: int) -> float:
        if rows <= 0 or self.draft_rows is None:
            return 0.0
        return self.draft_rows(rows) * self.scale * self.draft_scale

    def extend(self, rows: float) -> float:
        """Seconds of one draft extend over `rows` rows: its own table's, at the online scale and `extend_scale`
        (a pinned table, without one: a draft forward's price)."""
        if rows <= 0 or self.draft_rows is None:
            return 0.0
        if self.extend_rows is None:
            return self.draft(rows)
        return self.extend_rows(rows) * self.scale * self.extend_scale

    def observe_extend(self, rows: int, seconds: float) -> None:
        """A catch-up: one draft extend call over `rows` rows in all took `seconds`."""
        if self.frozen or rows <= 0 or self.extend_rows is None:
            return
        reading = seconds / max(self.extend_rows(rows) * self.scale, 1e-9)
        self.extend_scale = _ema_log(self.extend_scale, reading, EXTEND_SCALE_RANGE)

    def observe_target(self, requests: int, rows: int, seconds: float) -> None:
        """A decode round's target forward (no prefill in it): `requests` requests, `rows` rows in all."""
        if self.frozen or requests <= 0:
            return
        lo, hi = SCALE_READING
        # bounded around the scale so far, not around 1: around 1, a busy machine running every forward
        # past SCALE_READING's upper bound of the table was read at that bound, while the draft's prices, learned
        # apart from it (draft_scale), followed all the way and so read above their share of a round
        ratio = min(hi * self.scale, max(lo * self.scale, seconds / max(self._table(requests, rows), 1e-9)))
        self.scale += ONLINE_RATE * (ratio - self.scale)

    def observe_round(self, requests: int, outside_s: float, speculated: bool, predicted_draft_s: float,
                      speculating: int = 0, draft_s: float | None = None, predicted_extend_s: float = 0.0,
                      extend_s: float | None = None) -> None:
        """One decode round (no prefill in it): `outside_s` = its seconds outside the target forward,
        `predicted_draft_s` = what `draft` and `extend` predicted for its draft work, `predicted_extend_s` the
        extend's part of it where it has its own price (`extend`), `speculating` = its requests above depth 0,
        `draft_s` = the seconds of its draft work within outside_s where the caller timed it apart (then the
        draft levels' price learns from that, less `extend_s`, the catch-up's seconds (read by `observe_extend`;
        None: as predicted), and the rest is `round_overhead`)."""
        if self.frozen or requests <= 0:
            return
        if speculated and predicted_draft_s <= 0:
            # a model-free drafter (n-gram): no draft forward to scale, and its proposals cost next to nothing, so
            # what the round adds is the verify path's, which runs for the whole batch: `round_overhead`, per request.
            # Charged per speculating request instead, one n-gram request speculating in a large batch bore the whole
            # batch's verify path, and a lone request's depth-1 round was then priced at several plain ones (it never
            # speculated again)
            if self.off_overhead is not None:
                per = max(outside_s - self.off_overhead * requests, 0.0) / requests
                self.round_overhead = _ema_add(self.round_overhead, per)
            return
        if not speculated:
            per = outside_s / requests
            self.off_overhead = per if self.off_overhead is None else _ema_add(self.off_overhead, per)
            return
        levels = (predicted_draft_s - predicted_extend_s) / self.draft_scale  # the draft levels, at draft_scale 1
        extend_s = predicted_extend_s if extend_s is None else extend_s
        if draft_s is not None:
            if levels > 0:
                self.draft_scale = _ema_log(self.draft_scale, max(draft_s - extend_s, 1e-6) / levels,
                                            DRAFT_SCALE_RANGE)
            # a round with no draft level to price (depth 1: its proposal is the extend's top-k) leaves the tree's
            # Python, as the verify path's, to `round_overhead`
            per = max(outside_s - (draft_s if levels > 0 else extend_s) - (self.off_overhead or 0.0) * requests,
                      0.0) / requests
            self.round_overhead = _ema_add(self.round_overhead, per)
        elif levels > 0:
            # untimed (a caller that did not time its draft work apart): the whole of the round outside the target
            # and a plain round's bookkeeping counts as the draft's, never stuck at the startup price
            excess = max(outside_s - (self.off_overhead or 0.0) * requests - extend_s, 1e-6)
            self.draft_scale = _ema_log(self.draft_scale, excess / levels, DRAFT_SCALE_RANGE)

    def observe_spec_extra(self, measured_s: float, predicted_s: float, requests: int = 1,
                           option: int | None = None) -> None:
        """A speculating decode round of `requests` requests: `measured_s` = its seconds over a depth-0 round's, as
        this model prices that one; `predicted_s` = what the plan priced speculating at, before spec_scale;
        `option`: a lone request's (spec_scale)."""
        if self.frozen or predicted_s <= 0:
            return
        reading = max(measured_s, 1e-6) / predicted_s
        self.spec_readings += 1
        bucket = spec_bucket(requests)
        old = self._spec_scales.get(bucket, 1.0)
        self._spec_scales[bucket] = _ema_log(old, reading, SPEC_SCALE_RANGE)
        if requests == 1 and option is not None:
            self._option_scales[option] = _ema_log(self._option_scales.get(option, old), reading, OPTION_SCALE_RANGE)
            to = self._spec_scales[bucket]
            for k, scale in self._option_scales.items():
                if k != option:
                    self._option_scales[k] = scale * (to / scale) ** OPTION_RELAX

    def as_dict(self) -> dict:
        return {"clock": self.clock, "target_rows": dict(zip(self.target_rows.xs, self.target_rows.ys)),
                "per_request": self.per_request, "scale": self.scale, "draft_scale": self.draft_scale,
                "extend_scale": self.extend_scale,
                "off_overhead": self.off_overhead, "round_overhead": self.round_overhead,
                "spec_scale": {f"batch>={b}": s for b, s in sorted(self._spec_scales.items())},
                "option_scale": {str(k): s for k, s in sorted(self._option_scales.items())},
                "tree_factor": self.tree_factor,
                "draft_rows": dict(zip(self.draft_rows.xs, self.draft_rows.ys)) if self.draft_rows else None,
                "extend_rows": dict(zip(self.extend_rows.xs, self.extend_rows.ys)) if self.extend_rows else None}


def _ema_log(old: float, reading: float, bounds: tuple[float, float]) -> float:
    """One ONLINE_RATE step of a scale towards a reading (within OUTLIER x of it), in log space, both kept within
    `bounds`."""
    lo, hi = bounds
    reading = min(old * OUTLIER, max(old / OUTLIER, reading))
    return min(hi, max(lo, old * (min(hi, max(lo, reading)) / old) ** ONLINE_RATE))


def _ema_add(old: float, reading: float) -> float:
    """One ONLINE_RATE step of seconds towards a reading of at most OUTLIER x + OUTLIER_FLOOR_S of them."""
    return old + ONLINE_RATE * (min(reading, OUTLIER * old + OUTLIER_FLOOR_S) - old)
