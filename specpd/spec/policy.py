"""Adaptive speculation: each round, per request, the draft depth and width that pay (0 = a plain decode step).

Speculation buys tokens with compute: a round at depth k costs k more verify rows, k - 1 draft steps
and a draft extend over what it commits, and returns 1 + a_1 + a_1 a_2 + ... + a_1..a_k tokens in
expectation, where a_d is the chance the proposal at depth d is accepted once depth d - 1 was. Whether
that beats a plain decode step depends on this engine on this machine (a CPU verify over 8 rows costs
more than a GPU one) and on the batch (large batches are compute-bound). The policy:
  1. `CostModel` (cost.py): seconds of one target forward by (requests, rows) and of one draft
     forward by rows, measured at startup (calibration.calibrate); online, every decode round's
     timing scales the table (`CostModel.scale`), so a verify row keeps its measured share of a round.
  2. Per request, conditional acceptance a_d with exponential forgetting, shrunk towards a prior: the average
     over finished requests, pooled with the other running requests' outcomes (`AcceptanceEstimates`,
     accept.py).
  3. `plan` picks each request's depth by marginal value: with lam the batch's current tokens per
     second, a request takes the depth maximising E(k) - lam * (marginal seconds of k), iterated a few
     times; the plan is kept only if it beats everyone at depth 0. Each depth comes in two widths: the
     full tree (topk wide) and narrow, the draft's best k + 1 nodes (k verify rows): at batch 3 a K=4
     tree's 4 rows a request at depth 1 cross the CPU kernel's 6 -> 8-row step, where the top path's one
     row does not. A narrow round's acceptance has its own estimates (accept.py).
  4. A request at depth 0 re-probes depth 1 after `probe_every` rounds (doubling while probes fail),
     so a draft that became useful is noticed (with a draft state, EAGLE-family, a shadow probe: the
     request stays at depth 0, its draft catches up, and the probe's outcome is whether the token the
     plain step commits is the draft's top-1 — no verify row); its draft extend is deferred until it speculates again
     (SpecRunner keeps the features), so a useless draft costs nothing per step. Probes draw on an
     engine-wide budget of PROBE_BUDGET of the modelled time: a probe's cost falls on the whole batch
     while its gain is one request's, so at batch 16 sixteen requests probing on their own schedules
     would cost far more than one does at batch 1. The budget saves up PROBE_CREDIT_ROUNDS rounds' worth, or
     the price of the dearest probe waiting for it where that is more, so every probe is taken in time. A
     request whose draft is in step (nothing deferred: after a speculating round, or under PD the handoff's
     extend) shadow-probes for free.
  4b. What the deferred tokens cost: a catch-up is the work speculating again adds (nothing runs a request's
     deferred extends otherwise: they go to the prefix cache with its pages, defer.py), so a speculating
     decision is charged its rows, and a probe all it catches up, the prompt's rows included (4c). Until the
     cache kept the features, every finishing request ran its deferred extends (the settle), a catch-up was
     work moved earlier and went uncharged (`catch_up_settled`, which `--spec-adaptive-pinned` keeps: its rounds
     then depend on the request's own history only), and in a large chat batch the prompt catch-ups of probes that
     were priced one draft forward each, and the settles, were a real share of the step (evals/spec_depth0.py
     times both). A catch-up and a round's
     extend are priced as an extend runs (`CostModel.extend`: the head on the last row alone, its scale read off
     the catch-ups). (Charged in full while
     the engine settled them anyway, a request at depth 0 had come back only through a probe whose price grew a
     row a round, outgrowing what the budget saved: a decode server that never speculated, issue 31; the budget
     now saves up to the dearest waiting probe, 4.)
  4c. The prompt's extend is deferred too (SpecRunner._prompt_extend_now; not with a frozen policy, nor on a PD
     prefill server): it runs with the request's first catch-up, else never, so a request that never speculates
     costs no draft forward. Its rows are charged to no decision to speculate (`unpriced`): the eager extend
     paid them before any decision, and charging them would keep a new request from ever speculating. A request
     with its prompt waiting is not in step (its shadow probe waits for its interval).
  5. What a speculating round costs outside the target forward is measured each round in two parts: its
     draft work (catch-up, proposal, extend) against what the cost model predicted for its draft forwards,
     whose ratio scales the draft costs from then on (`CostModel.draft_scale`), and the rest (trees, verify,
     commit: paid by every request of the batch once any speculates) as seconds per request
     (`CostModel.round_overhead`), charged to any plan that speculates at all.
  5b. And the whole: a speculating round's measured cycle (its start to the next round's: postprocess, streaming
     and the HTTP thread's share of the GIL included) over what a depth-0 round of the same batch size took
     (measured the same way, an EMA per batch size) against what the plan priced speculating at scales every
     price of speculating (`CostModel.spec_scale`, never below 1), per batch-size bucket (1, 2-3, 4-7, 8-15,
     16+: what a batch of 32 pays beyond its price is not what a lone request pays). The parts above are read on
     the shape the startup table was timed on (one request, 128 tokens of context); a verify row at batch 32
     over a long context costs more than that, and without this the policy took rounds that cost more than
     they gave.
     A lone request's round runs one option, so there the scale is read per option and may go below 1: the
     startup table's shape differs start to start, and a start that read verify rows steep overpriced every
     speculating round of a lone request for its life (CostModel.spec_scale).
  6. A plan that put everyone at depth 0 stands without a search (`_idle_holds`) while the batch, the
     outcomes seen and the online prices stay as they were and the catch-ups only grow: the search is pure
     overhead on a round that then only decodes (evals/spec_depth0.py times it as `policy_plan`).
  7. A round that carries a prefill chunk does not speculate. Its price is the chunk's (hundreds of rows), so
     verify rows look free beside it, but no online reading corrects that price (only decode rounds are
     read: a chunk's own cost would be read as speculation's), and a speculating round's batch-wide cost
     (every decode request's verify, the catch-ups) is real: in a closed loop of many chat clients such rounds
     all speculated and the spec server fell behind the same server at depth 0. (A PD decode server has
     no prefill chunks; the anchors' EAGLE runs a prefill batch apart from the decode batch.)
It changes speed, never output: the verify is lossless whatever the depth.
`frozen=True` (tests): no online refinement and no engine-wide learning, so a request's plan depends
only on its own history (PD and unified then take identical rounds).
"""
from __future__ import annotations

from dataclasses import dataclass, field

from specpd.spec.accept import GLOBAL_RATE, AcceptanceEstimates
from specpd.spec.cost import OUTLIER, CostModel

PROBE_BUDGET = 0.005  # share of the modelled round time probes may spend (not frozen)
PROBE_CREDIT_ROUNDS = 64  # the budget saves up at most this many rounds' worth
IDLE_PRICE_DRIFT = 0.02  # the idle shortcut stands while the online prices moved less than this (relative)


@dataclass
class PlanStats:
    """What the policy chose (exported by /metrics and /server_info)."""

    rounds: int = 0
    rounds_off: int = 0  # rounds planned at depth 0
    rounds_narrow: int = 0  # rounds planned narrow (the draft's best depth + 1 nodes, not the full tree)
    probes: int = 0  # request rounds that probed (shadow: at depth 0, the draft's top-1 checked; else depth 1)
    proposed_hist: dict[int, int] = field(default_factory=dict)  # draft tokens proposed per round -> rounds

    def record(self, proposed: int, off: bool) -> None:
        self.rounds += 1
        self.rounds_off += int(off)
        self.proposed_hist[proposed] = self.proposed_hist.get(proposed, 0) + 1


class AdaptivePolicy(AcceptanceEstimates):
    def __init__(self, num_steps: int, topk: int, num_draft_tokens: int, cost: CostModel, frozen: bool = False,
                 shadow: bool = False, catch_up_settled: bool = False):
        super().__init__(num_steps, topk, num_draft_tokens, frozen)
        self.cost = cost
        # a catch-up priced as work moved earlier, not added (module docstring, 4b: --spec-adaptive-pinned)
        self.catch_up_settled = catch_up_settled
        # shadow probes (a drafter with a draft state, EAGLE-family): a probing request stays at depth 0 and
        # only catches its draft up; whether the token it then commits is the draft's top-1 is the probe's
        # outcome. It costs the catch-up extend without a verify row (at batch 8 one more row crosses the
        # CPU kernel's 8-row block, a step up in the whole forward's cost)
        self.shadow = shadow
        self.shadow_probes: list[str] = []  # the last plan's shadow-probing requests
        self.stats = PlanStats()
        self.probe_credit = 0.0  # seconds of modelled time probes may still spend (PROBE_BUDGET)
        self.last_draft_s = 0.0  # the last plan's predicted draft seconds (for CostModel.observe_round)
        self.last_extend_s = 0.0  # its extend's part where that has a price of its own (CostModel.extend)
        # the last plan's (depth-0 round seconds, seconds speculating adds before CostModel.spec_scale), priced;
        # None when it did not speculate
        self.last_extra: tuple[float, float] | None = None
        self._plain_round_s: dict[int, float] = {}  # batch size -> seconds of a depth-0 decode round (EMA)
        # the idle shortcut: a plan that put every request at depth 0 by the search's first pass, and what it
        # was made from (`plan`)
        self._idle: tuple | None = None

    # -- shape of a round -------------------------------------------------------------------
    def rows(self, k: int) -> int:
        """Verify rows (root included) of a round at option k: depth k at full width, -k: depth k narrow
        (the draft's best k + 1 nodes, root included)."""
        if k < 0:
            return 1 - k
        if k == 0:
            return 1
        if self.topk == 1:
            return k + 1
        return min(self.num_draft_tokens, 1 + self.topk + (k - 1) * self.topk * self.topk)

    def frontier(self, level: int) -> int:
        """Draft rows one request runs at draft step `level` (>= 1)."""
        return 1 if self.topk == 1 else self.topk

    # -- the plan ---------------------------------------------------------------------------
    def plan(self, request_ids: list[str], other_requests: int = 0, other_rows: int = 0,
             pending: list[int] | None = None, unpriced: list[int] | None = None) -> list[tuple[int, int]]:
        """(num_steps, num_draft_tokens) per request; (0, 1) = plain decode. other_*: prefill items
        sharing the target forward; pending: each request's deferred draft-extend tokens (the catch-up
        it runs if it speculates now); unpriced: its deferred prompt-extend tokens, run with the catch-up but
        charged to no decision (4c)."""
        n = len(request_ids)
        if n == 0:
            return []
        deferred = list(pending) if pending is not None else None  # None: the caller tracks no catch-ups
        pending = deferred or [0] * n
        # what the decisions charge for the catch-ups (4b); `pending` itself is what the round will run
        priced = [0] * n if self.catch_up_settled else pending
        # what a catch-up now runs (4c: the prompt's rows too); `deferred` stays what probes are charged
        waiting = pending if unpriced is None else [p + u for p, u in zip(pending, unpriced)]
        if other_requests and not self.frozen:  # a round with a prefill chunk: depth 0 (module docstring, 7)
            self.shadow_probes = []
            return self._finish_plan(request_ids, [0] * n, None, waiting, (priced, other_requests, other_rows))
        key = (tuple(request_ids), other_requests, other_rows, self._observed, self.cost.spec_readings)
        if self._idle_holds(key, priced):
            # nothing an estimate or a price depends on moved since a search put everyone at depth 0, and the
            # catch-ups only grew (every option's cost grows with them): the search would say depth 0 again
            depth = [0] * n
            gains = self._probe(request_ids, depth, (None, priced, other_requests, other_rows), deferred, waiting)
            return self._finish_plan(request_ids, depth, gains, waiting, (priced, other_requests, other_rows))
        # an option k: depth k at full width, -k: depth k narrow; gains[i][k] indexes both (a narrow
        # depth's expectation sits at the list's end, so gains[i][-k] is it)
        gains = self._gains(request_ids)
        options = [o for k in range(1, self.num_steps + 1) for o in ((k, -k) if self.narrow_ok else (k,))]
        extra = (gains, priced, other_requests, other_rows)
        base_time = max(self._round_time([0] * n, *extra), 1e-9)
        # start from the best option shared by everyone (a draft forward's fixed cost is shared, which
        # one request's marginal view would not see), then let each request move from there
        uniform = max([0] + options,
                      key=lambda k: sum(g[k] for g in gains) / self._round_time([k] * n, *extra))
        depth = [uniform] * n
        lam = max(n / base_time, sum(g[uniform] for g in gains) / self._round_time(depth, *extra))
        cost, steps = self.cost, self.num_steps
        req = other_requests + n
        spec_scale = {k: cost.spec_scale(req, k) for k in options}
        drafts = cost.draft_rows is not None  # a model-free drafter's draft and extend cost nothing (CostModel)
        verify_at: dict[int, list[float]] = {}  # the batch's rows with a request at depth 0 -> each option's verify
        for sweep in range(3):
            rows = other_rows + sum(self.rows(k) for k in depth)
            level_rows = [sum(self.frontier(s) for k in depth if abs(k) > s) for s in range(steps)]
            # marginal seconds of one request's frontier at draft level s, whether or not it is there now
            add = [cost.draft(level_rows[s] + self.frontier(s)) - cost.draft(level_rows[s]) for s in range(steps)]
            own = [cost.draft(level_rows[s]) - cost.draft(level_rows[s] - self.frontier(s)) for s in range(steps)]
            ext_total = sum(g[k] + p for g, k, p in zip(gains, depth, priced) if k != 0)
            new = []
            for i in range(n):
                ext_rows = ext_total - (gains[i][depth[i]] + priced[i] if depth[i] != 0 else 0.0)
                ext_base = cost.extend(ext_rows)
                # the batch's rows with this request at depth 0: its verify rows are priced exactly from there
                # (the CPU kernel's cost steps at row blocks; a derivative at one point misprices k rows)
                rows_base = rows - self.rows(depth[i]) + 1
                verify = verify_at.get(rows_base)
                if verify is None:  # (a batch at one depth shares it: at b32 the search priced it 32 times a sweep)
                    target_base = cost.target(req, rows_base)
                    verify = verify_at[rows_base] = [
                        (cost.target(req, rows_base + self.rows(k) - 1) - target_base) * cost.tree_factor
                        for k in options]
                best_k, best_v, draft, extend = 0, 0.0, 0.0, 0.0
                for j, k in enumerate(options):  # a narrow depth drafts as its full one: only its verify rows differ
                    if k > 1:
                        draft += own[k - 1] if abs(depth[i]) > k - 1 else add[k - 1]
                    if drafts:
                        extend = cost.extend(ext_rows + gains[i][k] + priced[i]) - ext_base
                    value = (gains[i][k] - 1.0) - lam * spec_scale[k] * (verify[j] + draft + extend)
                    if value > best_v:
                        best_k, best_v = k, value
                new.append(best_k)
            if new == depth:  # a fixed point: lam and every marginal cost would come out the same again
                if sweep == 0 and not any(depth):
                    self._idle = (key, list(priced), cost.scale, cost.draft_scale)
                break
            depth = new
            lam = max(lam, sum(g[k] for g, k in zip(gains, depth)) / self._round_time(depth, *extra))
        if sum(g[k] for g, k in zip(gains, depth)) / self._round_time(depth, *extra) <= n / base_time:
            depth = [0] * n
        self._probe(request_ids, depth, extra, deferred, waiting)
        return self._finish_plan(request_ids, depth, gains, waiting, (priced, other_requests, other_rows))

    def _idle_holds(self, key: tuple, pending: list[int]) -> bool:
        """The last all-zero plan still stands: same requests, batch and outcomes seen, no catch-up shorter, and
        the online prices within IDLE_PRICE_DRIFT of what they were (their drift is the one input not counted)."""
        idle = self._idle
        if idle is None or idle[0] != key or any(p < q for p, q in zip(pending, idle[1])):
            return False
        return (abs(self.cost.scale / idle[2] - 1.0) < IDLE_PRICE_DRIFT
                and abs(self.cost.draft_scale / idle[3] - 1.0) < IDLE_PRICE_DRIFT)

    def _finish_plan(self, request_ids: list[str], depth: list[int], gains, pending: list[int], priced: tuple
                     ) -> list[tuple[int, int]]:
        if gains is None and any(depth):  # the idle shortcut, and a frozen policy's probe: its round's estimates
            gains = self._gains(request_ids)
        # what the round's draft forwards will cost, catch-ups in full (CostModel.observe_round compares)
        extend = self._extend_time(depth, gains, pending) if any(depth) else 0.0
        self.last_draft_s = self._levels_time(depth) + extend
        self.last_extend_s = extend if self.cost.extend_rows is not None else 0.0
        self.last_extra = None
        if any(depth) and not self.frozen:  # what speculating adds to this round, as priced (observe_round_time)
            # with the catch-ups it will run (`pending`), which a decision may leave uncharged (4b) but the round's
            # cycle holds: read against the decisions' price, a lone request's first round back from depth 0 (its
            # catch-up dozens of rows) read its option dear, and that option was not chosen again
            run = (pending, *priced[1:])
            base = self._round_time([0] * len(depth), gains, *run)
            option = self._option(depth, priced[1])
            scale = self.cost.spec_scale(len(depth) + priced[1], option)
            self.last_extra = (base, (self._round_time(depth, gains, *run) - base) / scale, option)
        for rid, k in zip(request_ids, depth):
            self._narrow[rid] = k < 0
        self.stats.rounds_narrow += sum(1 for k in depth if k < 0)
        return [(abs(k), self.rows(k)) for k in depth]

    def _gains(self, request_ids: list[str]) -> list[list[float]]:
        rates = [self.accept_rates(r) for r in request_ids]
        gains = [self.expected_tokens(a) for a in rates]
        if self.narrow_ok:
            share = self.top_path_share()
            gains = [g + self.expected_tokens(self.accept_rates(r, narrow=True, full=a, share=share))[:0:-1]
                     for g, r, a in zip(gains, request_ids, rates)]
        return gains

    def _probe(self, request_ids: list[str], depth: list[int], extra: tuple, pending: list[int] | None,
               waiting: list[int]) -> list[list[float]] | None:
        """Requests idle for their probe interval try depth 1 (in place), the longest idle first, while the
        engine-wide budget lasts (frozen: no budget, so a request's plan depends on its history only); with
        shadow probes, a request whose draft is in step (nothing `waiting`, its prompt included) probes whenever
        it is at depth 0: its outcome costs nothing. Returns the round's estimates: extra's, or those a probe after
        the idle shortcut had to compute."""
        ready = []
        lone = len(request_ids) == 1  # idle statistics decay for a lone request only (accept.idle_round)
        for i, rid in enumerate(request_ids):
            st = self._get(rid)
            st.probing = False
            if depth[i] == 0:
                st.idle_rounds += 1
                self.idle_round(st, lone)
                if st.idle_rounds >= st.probe_every or (self.shadow and pending is not None and waiting[i] == 0):
                    ready.append((st.idle_rounds - st.probe_every, i, st))
            else:
                st.idle_rounds = 0
        now = 0.0
        if not self.frozen:
            now = self._round_time(depth, *extra)
            self.probe_credit += PROBE_BUDGET * now
        needed = 0.0  # the dearest probe that waited for the budget: the credit saves up to it (below)
        self.shadow_probes = []
        for _, i, st in sorted(ready, key=lambda r: -r[0]):
            if self.shadow:  # the catch-up extend alone
                if not self.frozen:
                    cost = self._catch_up_cost(pending[i] if pending is not None else None, waiting[i])
                    if cost > self.probe_credit:
                        needed = max(needed, cost)
                        continue  # stays ready: it probes once the budget allows
                    self.probe_credit -= cost
                self.shadow_probes.append(request_ids[i])
                self.stats.probes += 1
                st.probing, st.idle_rounds = True, 0
                continue
            depth[i] = 1
            if not self.frozen:
                if extra[0] is None:  # the idle shortcut skipped the estimates: this probe's round needs them
                    extra = (self._gains(request_ids), *extra[1:])
                trial = self._round_time(depth, *extra)
                if trial - now > self.probe_credit:
                    needed = max(needed, trial - now)
                    depth[i] = 0  # stays ready: it probes once the budget allows
                    continue
                self.probe_credit -= trial - now
                now = trial
            self.stats.probes += 1
            st.probing, st.idle_rounds = True, 0
        if not self.frozen:
            # saved up to PROBE_CREDIT_ROUNDS rounds' worth, or to the dearest waiting probe where that costs more: a
            # probe dearer than the cap (a lone request's depth-1 round once spec_scale has risen) was never taken,
            # so its request never learned it accepts (a grounded n-gram request whose drafts nearly always
            # pass decoded plainly)
            self.probe_credit = min(self.probe_credit, max(PROBE_BUDGET * PROBE_CREDIT_ROUNDS * now, needed))
        return extra[0]

    def _catch_up_cost(self, pending: int | None, waiting: int) -> float:
        """What bringing a request's draft in step before this round adds: nothing when nothing waits (`waiting`:
        the deferred rows, the prompt's included); one more draft forward where catch-ups count as work moved
        earlier (4b) or the caller tracks none (None); else every waiting row and, as a round's own extend would,
        this round's."""
        if pending is None:
            return self.cost.extend(1)
        if waiting <= 0:
            return 0.0
        if self.catch_up_settled:
            return self.cost.extend(1)
        return self.cost.extend(waiting + 1)

    def _round_time(self, depth: list[int], gains: list[list[float]], pending: list[int], other_requests: int,
                    other_rows: int) -> float:
        req, rows = other_requests + len(depth), other_rows + sum(self.rows(k) for k in depth)
        plain = self.cost.target(req, other_rows + len(depth))
        target = plain + (self.cost.target(req, rows) - plain) * self.cost.tree_factor
        speculating = sum(1 for k in depth if k != 0)
        extra = (target - plain + self._draft_time(depth, gains, pending)
                 + (self.cost.round_overhead * len(depth) if speculating else 0.0))
        scale = self.cost.spec_scale(req, self._option(depth, other_requests))
        return max(1e-9, plain + scale * extra)  # (never 0: rates divide by it)

    @staticmethod
    def _option(depth: list[int], other_requests: int) -> int | None:
        """A lone request's option, which its round's spec_scale is read and priced by (CostModel.spec_scale)."""
        return depth[0] if len(depth) == 1 and not other_requests else None

    def _draft_time(self, depth: list[int], gains: list[list[float]], pending: list[int]) -> float:
        """The round's draft forwards: one per draft level past the first, and the extend (catch-up included)."""
        if self.cost.draft_rows is None or not any(depth):  # (a model-free drafter runs none)
            return 0.0
        return self._levels_time(depth) + self._extend_time(depth, gains, pending)

    def _levels_time(self, depth: list[int]) -> float:
        """The round's draft forwards past the first level (the extend's top-k is the first)."""
        return sum(self.cost.draft(sum(self.frontier(s) for k in depth if abs(k) > s))
                   for s in range(1, self.num_steps))

    def _extend_time(self, depth: list[int], gains: list[list[float]], pending: list[int]) -> float:
        """The round's draft extend, its catch-up included (CostModel.extend)."""
        return self.cost.extend(int(round(sum(g[k] + p for g, k, p in zip(gains, depth, pending) if k != 0))))

    # -- feedback ---------------------------------------------------------------------------
    def observe_round_time(self, requests: int, seconds: float, speculated: bool) -> None:
        """A decode round (no prefill in it, no draft model's shadow probe) took `seconds` in all, start to next
        start. At depth 0 it is what a plain round of this batch costs (an EMA per batch size); a round the last plan
        speculated in is read against that: what speculating added, over what the plan priced it at, corrects every
        price of speculating (`CostModel.spec_scale`, module docstring 5b)."""
        if self.frozen:
            return
        if not speculated:  # (a stalled round moves it by a bounded step: cost.OUTLIER)
            old = self._plain_round_s.get(requests)
            self._plain_round_s[requests] = seconds if old is None else \
                old + GLOBAL_RATE * (min(seconds, OUTLIER * old) - old)
            return
        if self.last_extra is None:
            return
        base, predicted, option = self.last_extra
        plain = self._plain_round_s.get(requests)
        if plain is None:  # no depth-0 round of this batch read yet: the model's price of one
            plain = base + (self.cost.off_overhead or 0.0) * requests
        self.cost.observe_spec_extra(seconds - plain, predicted, requests, option)
        self.last_extra = None

    def release(self, request_id: str) -> None:
        self.forget(request_id)
        self._narrow.pop(request_id, None)
        self._idle = None  # its estimates are gone: a later request under the same id starts from the prior
