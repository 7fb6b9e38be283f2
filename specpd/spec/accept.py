"""Adaptive speculation's acceptance estimates (policy.py, steps 2 and 3's narrow shape), per request.

  2. Per request, conditional acceptance a_d with exponential forgetting; depth 1 is shrunk towards
     the per-request average (the prior a new request starts from: each finished request's whole-life rate,
     weighted by how many outcomes it saw), a deeper depth towards the request's own rate one level up (scaled
     by the same average's trend between the levels; a level no finished request tried follows the level above,
     `prior_rates`).
  3. (the narrow shape) A narrow round's acceptance is read off every verify's accepted path (the leading
     nodes that were their parent's top-ranked child); its prior is the request's full-width rate times
     the top path's share of it, learned engine-wide from the same full-width rounds (paired: an
     engine-wide narrow rate would be learned on the requests that chose narrow, the ones accepting most).
`observe` reads each verify's (or probe's) outcome into them; a probe's outcome also sets when the request
probes next (policy.py, step 4). `frozen=True`: no engine-wide learning.
"""
from __future__ import annotations

from dataclasses import dataclass, field

PRIOR_ACCEPT = 0.5  # engine-wide conditional acceptance before any round is seen
PRIOR_TOP_PATH = 0.75  # the top path's share of a full tree's conditional acceptance, before any pair is seen
PRIOR_WEIGHT = 4.0  # pseudo-rounds of the engine-wide rate in each request's estimate
DECAY = 0.9  # a request's statistics forget at this rate per round (acceptance drifts with the text)
GLOBAL_RATE = 0.1  # engine-wide EMA step per observation: a useless draft is known within a few rounds
# a new request's prior is the per-request average (each finished request's whole-life conditional rate per depth,
# EMA at this step per request, a request with fewer than REQUEST_EVIDENCE outcomes at a depth moving it that much
# less), not the per-observation rate: that holds the last request's last rounds, and it swings request to request
# where the per-request average holds steady. After a reply that ended accepting well, a batch of new requests
# started from it bet deep rounds, each costing several plain ones; taken as the lower of the two, it started
# requests so low that one miss put them at depth 0, over rounds where a fixed-depth server committed several
# tokens each (issue 32)
REQUEST_RATE = 0.2
REQUEST_EVIDENCE = 16
# the other running requests' outcomes so far count with it, the average weighing as this many outcomes: a batch of
# requests whose draft is useless learns it from each other's misses within a few rounds (alone, each one's own
# misses against the prior's weight kept it where a cheap verify row still paid). A lone request has no
# others: its prior is the finished requests' average
PRIOR_POOL = 8.0
PROBE_MIN, PROBE_MAX = 8, 128
# a shadow probe's interval stops doubling here: it costs no verify row (its catch-up draws on the probe budget),
# and it is the only way back to speculating once the engine-wide rate fell (a lone-request server whose first
# replies accepted little probed every PROBE_MAX rounds, about once a reply, and stayed at depth 0: issue 32)
SHADOW_PROBE_MAX = 32
# a request at depth 0 forgets too: every IDLE_DECAY_EVERY rounds there its statistics decay by IDLE_DECAY, so its
# estimate drifts back to the engine-wide prior. Forgetting only per outcome kept a lone chat request whose last
# verifies missed at depth 0 for the rest of its reply (the text moved on, its estimate did not): most of a
# lone-request server's rounds, where every speculating round class committed a token in less time (issue 32)
IDLE_DECAY, IDLE_DECAY_EVERY = 0.7, 8


@dataclass
class RequestStats:
    accepted: list[float]  # [S] decayed rounds whose proposal at depth d + 1 was accepted
    attempted: list[float]  # [S] decayed rounds that reached depth d + 1 with a proposal there
    # the same for the narrow shape (a K-wide tree cut to depth + 1 nodes: the draft's top path), read off
    # every verify: a round at full width counts the leading accepted nodes that were their parent's top child
    chain_accepted: list[float] = field(default_factory=list)
    chain_attempted: list[float] = field(default_factory=list)
    lifetime_accepted: list[float] = field(default_factory=list)  # [S] as accepted / attempted, undecayed
    lifetime_attempted: list[float] = field(default_factory=list)  # (full-width rounds and shadow probes)
    idle_rounds: int = 0  # consecutive rounds at depth 0
    idle_since_decay: int = 0  # rounds at depth 0 since its statistics last decayed for it (IDLE_DECAY)
    probe_every: int = PROBE_MIN
    probing: bool = False


class AcceptanceEstimates:
    """Conditional acceptance per request and engine-wide (module docstring); AdaptivePolicy plans on them."""

    def __init__(self, num_steps: int, topk: int, num_draft_tokens: int, frozen: bool = False):
        self.num_steps, self.topk, self.num_draft_tokens = num_steps, topk, num_draft_tokens
        self.frozen = frozen
        self.global_accept = [PRIOR_ACCEPT] * num_steps
        # engine-wide observations per level: an unseen level follows the one above (`effective_global`). Its
        # prior held at PRIOR_ACCEPT while the levels above learned near-certain acceptance (a grounded n-gram
        # copying spans) read as a falling trend past the deepest level tried, so no request went deeper: the
        # adaptive policy committed fewer tokens a verify than a fixed chain of the full depth (issue 32)
        self.global_seen = [0] * num_steps
        # per depth, averaged over finished requests (REQUEST_RATE): the prior a new request starts from
        self.request_rates = [PRIOR_ACCEPT] * num_steps
        self.request_seen = [0] * num_steps  # finished requests that reached each depth
        self.live_accepted = [0.0] * num_steps  # the running requests' lifetime counts, summed (PRIOR_POOL)
        self.live_attempted = [0.0] * num_steps
        # the narrow shape's prior: how often the top path reaches depth d + 1 when the full tree does, read off
        # the same full-width rounds (paired, so which requests speculate biases neither side); a request's narrow
        # estimate starts from its own full-width estimate scaled by it (the engine-wide narrow rate would be
        # learned on the requests that chose narrow: the ones accepting most)
        self.top_reach = [PRIOR_TOP_PATH ** (d + 1) for d in range(num_steps)]  # EMA: top path reached d + 1
        self.tree_reach = [1.0] * num_steps  # EMA: the tree reached d + 1 (same rounds)
        # a narrow round (budget depth + 1) is an option only where the full tree is wider than a chain
        self.narrow_ok = topk > 1 and num_draft_tokens > 2
        self._narrow: dict[str, bool] = {}  # request id -> its last plan was narrow
        self._stats: dict[str, RequestStats] = {}
        self._observed = 0  # verify / probe outcomes seen (every one may change an estimate)

    def _get(self, request_id: str) -> RequestStats:
        st = self._stats.get(request_id)
        if st is None:
            z = [0.0] * self.num_steps
            st = self._stats[request_id] = RequestStats(list(z), list(z), list(z), list(z), list(z), list(z))
        return st

    def accept_rates(self, request_id: str, narrow: bool = False, full: list[float] | None = None,
                     share: list[float] | None = None) -> list[float]:
        """Conditional acceptance per depth. Depth 1's prior is the per-request average (`prior_rates`); a deeper
        depth's is this request's rate one level up, scaled by that average's trend between the two levels, so a
        request that keeps accepting (a copied span) is expected to keep accepting deeper than it has
        tried yet, and one that fails early is not. narrow: the top path's, whose prior at depth 1 is the
        request's full-width rate times the top path's share of it (`top_path_share`), and deeper the request's
        own narrow rate one level up times the trend of that prior. (Priors taken from the full width at every
        depth kept a request whose narrow rounds nearly always accepted priced low one level deeper, which it
        then never tried: a grounded n-gram request stayed short of the full depth, issue 32.) `full`, `share`: the
        request's full-width rates and `top_path_share()` where the caller has them (a plan reads every request's)."""
        st = self._get(request_id)
        if narrow:
            share = self.top_path_share() if share is None else share
            full = self.accept_rates(request_id) if full is None else full
            base = [min(1.0, a * s) for a, s in zip(full, share)]
            rates = []
            for d, (acc, att) in enumerate(zip(st.chain_accepted, st.chain_attempted)):
                # deeper than depth 1, like the full width's: the request's own narrow rate one level up, scaled
                # by the trend of the full-width-derived prior between the levels (1 where neither level was
                # learned), so a narrow chain accepting a copied span is expected to go on accepting
                prior = base[0] if d == 0 else min(1.0, rates[-1] * base[d] / max(base[d - 1], 1e-3))
                rates.append((acc + PRIOR_WEIGHT * prior) / (att + PRIOR_WEIGHT))
            return rates
        g = self.prior_rates(st)
        rates, prior = [], g[0]
        for d, (acc, att) in enumerate(zip(st.accepted, st.attempted)):
            if d > 0:
                prior = min(1.0, rates[-1] * g[d] / max(g[d - 1], 1e-3))
            rates.append((acc + PRIOR_WEIGHT * prior) / (att + PRIOR_WEIGHT))
        return rates

    def effective_global(self) -> list[float]:
        """The engine-wide conditional acceptance per level, a level never observed taking the one above's."""
        out = []
        for d, (rate, seen) in enumerate(zip(self.global_accept, self.global_seen)):
            out.append(rate if seen or d == 0 else out[-1])
        return out

    def prior_rates(self, own: RequestStats | None = None, running: bool = True) -> list[float]:
        """Per level, the per-request average conditional acceptance (REQUEST_RATE; a level no finished request
        reached taking the one above's) with the other running requests' outcomes so far (PRIOR_POOL; not frozen,
        not `running=False`): the prior of the request whose statistics are `own` (None: a new request's)."""
        out = []
        for d, (rate, seen) in enumerate(zip(self.request_rates, self.request_seen)):
            base = rate if seen or d == 0 else out[-1]
            if running and not self.frozen:
                acc, att = self.live_accepted[d], self.live_attempted[d]
                if own is not None:
                    acc, att = acc - own.lifetime_accepted[d], att - own.lifetime_attempted[d]
                base = (base * PRIOR_POOL + max(acc, 0.0)) / (PRIOR_POOL + max(att, 0.0))
            out.append(base)
        return out

    def top_path_share(self) -> list[float]:
        """[S]: the top path's conditional acceptance at depth d + 1 over the full tree's, engine-wide, from
        paired full-width rounds (a ratio of reach rates, so each level's is its reach ratio over the one above)."""
        out, above = [], 1.0
        for top, tree in zip(self.top_reach, self.tree_reach):
            reach = min(above, top / max(tree, 1e-6))
            out.append(reach / max(above, 1e-6))
            above = reach
        return out

    @staticmethod
    def expected_tokens(rates: list[float]) -> list[float]:
        """[S + 1]: expected tokens committed by a round at depth k = 0..S (bonus included)."""
        out, reach = [1.0], 1.0
        for a in rates:
            reach *= a
            out.append(out[-1] + reach)
        return out

    # -- feedback ---------------------------------------------------------------------------
    def observe(self, request_id: str, proposed_depth: int, num_accepted: int, top_path: int | None = None,
                shadow: bool = False) -> None:
        """One verify round: the tree reached `proposed_depth`, `num_accepted` proposals were kept, the first
        `top_path` of them each its parent's top-ranked child (what a narrow round would have kept). shadow: a
        shadow probe (its outcome is the draft's top-1 against the committed token, no tree)."""
        st = self._get(request_id)
        if proposed_depth <= 0:
            if st.probing:  # the drafter had nothing to offer (an n-gram without a match): probe again next round
                self._observed += 1  # (not the plan the idle shortcut kept)
                st.idle_rounds = st.probe_every
            return
        self._observed += 1
        if st.probing:
            st.probe_every = PROBE_MIN if num_accepted > 0 else \
                min(2 * st.probe_every, SHADOW_PROBE_MAX if shadow else PROBE_MAX)
        if self._narrow.get(request_id, False):  # a narrow round: its outcome is the narrow shape's only
            self._count(st.chain_accepted, st.chain_attempted, None, proposed_depth, num_accepted)
            return
        self._count(st.accepted, st.attempted, self.global_accept, proposed_depth, num_accepted)
        for d in range(min(num_accepted + 1, proposed_depth)):
            hit = float(d < num_accepted)
            st.lifetime_attempted[d] += 1.0
            st.lifetime_accepted[d] += hit
            self.live_attempted[d] += 1.0
            self.live_accepted[d] += hit
        if top_path is not None and self.narrow_ok:
            self._count(st.chain_accepted, st.chain_attempted, None, proposed_depth, top_path)
            if not self.frozen and not shadow:  # a shadow probe tested its top-1 only: not a pair
                for d in range(proposed_depth):
                    self.top_reach[d] += GLOBAL_RATE * (float(top_path > d) - self.top_reach[d])
                    self.tree_reach[d] += GLOBAL_RATE * (float(num_accepted > d) - self.tree_reach[d])

    def idle_round(self, st: RequestStats, lone: bool) -> None:
        """A round `st`'s request spent at depth 0: once IDLE_DECAY_EVERY of them passed, its statistics decay in the
        next round it runs `lone` (not frozen). A decay is an observation for the idle shortcut (the estimates
        moved). Lone requests only: in a batch a request's return to speculating puts the whole batch in a
        speculating round, and with the decay at every batch size a closed loop of chat clients speculated in
        more rounds and lost more to plain (evals/spec_depth0.py --closed-loop); each request's
        decays on its own schedule there also broke the idle shortcut in nearly every round of a larger loop."""
        st.idle_since_decay += 1
        if self.frozen or not lone or st.idle_since_decay < IDLE_DECAY_EVERY:
            return
        st.idle_since_decay = 0
        for counts in (st.accepted, st.attempted, st.chain_accepted, st.chain_attempted):
            counts[:] = [c * IDLE_DECAY for c in counts]
        self._observed += 1

    def forget(self, request_id: str) -> None:
        """A request is gone: its whole-life rate at each depth it reached moves the per-request average (a new
        request's prior), by as much as the outcomes it saw there warrant (REQUEST_EVIDENCE)."""
        st = self._stats.pop(request_id, None)
        if st is None:
            return
        for d, (acc, att) in enumerate(zip(st.lifetime_accepted, st.lifetime_attempted)):
            self.live_accepted[d] = max(0.0, self.live_accepted[d] - acc)
            self.live_attempted[d] = max(0.0, self.live_attempted[d] - att)
        if self.frozen:
            return
        above = self.prior_rates(running=False)
        for d, (acc, att) in enumerate(zip(st.lifetime_accepted, st.lifetime_attempted)):
            if att <= 0:
                continue
            if not self.request_seen[d]:  # its first reading: it starts from the level above
                self.request_rates[d] = above[d]
            self.request_seen[d] += 1
            step = REQUEST_RATE * min(1.0, att / REQUEST_EVIDENCE)
            self.request_rates[d] += step * (acc / att - self.request_rates[d])

    def _count(self, accepted: list[float], attempted: list[float], engine_wide: list[float] | None, depth: int,
               num_accepted: int) -> None:
        for d in range(self.num_steps):
            accepted[d] *= DECAY
            attempted[d] *= DECAY
        for d in range(min(num_accepted + 1, depth)):
            attempted[d] += 1.0
            hit = d < num_accepted
            accepted[d] += float(hit)
            if engine_wide is not None and not self.frozen:
                if d > 0 and not self.global_seen[d]:  # its first reading: it starts from the level above
                    engine_wide[d] = self.effective_global()[d]
                self.global_seen[d] += 1
                engine_wide[d] += GLOBAL_RATE * (float(hit) - engine_wide[d])
