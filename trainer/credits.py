"""Region credits: how admitted groups are split between regions (DESIGN.md §1, §6).

A region's credit follows its measured throughput in groups per second: the groups that arrived
from it in the last `window_s`, or, where its nodes' heartbeats report more, their decoding rate
(tokens/s over the tokens of one group). A region not yet measured borrows the mean of the
measured ones, scaled by its configured `weight`. A partitioned or dead region stops arriving and
stops heartbeating, so its credit falls to zero within one window and nothing waits on it; when it
comes back, its heartbeats give it credit again.

The next group goes to the region expected to return it first: the larger of the region's measured
latency (dispatch to arrival, median over the window: a preemption's stranded groups do not
count for more than their number) and its backlog drained at its throughput,
`(in_flight + 1) / rate`, where the rate is the larger of what it returned and what its serving
nodes deliver while busy (their `busy_tokens_per_s` over a group's tokens, the moving mean of the
groups that arrived): a region given little work returns little, and judged by its arrivals alone a
fast region that idles would keep looking slow (`bench/pipeline.py`'s fast region idled 83 % of an
async run that way). With length-aware placement (`rollout.length_aware`, `lengths.py`) the
latency, measured on average groups, is scaled by the group's predicted length over the average: a
long group goes where tokens come back fastest, while short ones fill the regions by backlog (a
first version weighed the backlog by length instead, and sent nearly every group to the fast
region: short groups looked free). Throughput alone would keep a slow region's in-flight work
proportional to its rate; but admission bounds the work in flight to `(1 + max_staleness) *
groups_per_step`, so a region whose groups take many steps to come back would hold admission slots
for groups that end up stale. Latency sends it only what it can return in time.

In `algorithm.mode: sync` (`by_capacity`) the split is the one a synchronous trainer over the same
workers makes: each step's groups in proportion to each region's capacity, the tokens per second its
nodes deliver while their engines have work (`busy_tokens_per_s` in their heartbeats), so that its
share of the step finishes when the others' do. Throughput and latency would not do there: a sync
region returns only what it was given, so a region given little measures little and is given less
(the fast region of `bench/pipeline.py` idled 99 % of a sync run that way). Capacity is the engines'
own rate, whatever their load; a node that has not measured it yet borrows the mean of the measured
nodes, scaled by its region's `weight`.

With `trainer.placement.price_aware` (async mode; off by default), the next group goes instead to the
region where a useful group is cheapest, among those expected to return it within the horizon: the
time the learner takes to consume the admission window, `(1 + max_staleness)` step intervals (or
`placement.horizon_s`). A useful group's price is the region's spend rate (its live nodes times their
price per node-hour, `cost.py`) over the groups per second its serving nodes deliver (their capacity
over a group's tokens) net of its measured preemption waste (the share of its groups lost in the
window: sent again from scratch, or arrived as duplicates or stale), plus its link's transfer cost per
group. A region that cannot return a group in time is never preferred for its price: where none can,
the earliest return wins, so on-demand capacity remains the floor that keeps the trainer fed when
spot capacity is gone or saturated, and spot whose preemptions waste more than its discount saves
loses its place to on-demand. Ties (unpriced regions) go by expected return, as without it.

Only a node that serves counts, in both modes: `up` with at least one engine `up`
(`Heartbeat.serving`; a heartbeat without engine statuses, from an older agent, serves when `up`). An
agent is `up` while its engines still load the model (tens of seconds after a preemption's
replacement) or restart; work sent there waits for them, so such a node adds no capacity and no
decoding rate, does not make its idle region worth probing, and a region whose fresh heartbeats show
no serving node has no rate, whatever it returned earlier in the window.
"""

from __future__ import annotations

import statistics
from collections import deque
from dataclasses import dataclass, field
from typing import Any

_TOKENS_ALPHA = 0.05
"""Weight of the newest group in the moving mean of a group's tokens."""


@dataclass(slots=True)
class _Region:
    weight: float
    arrivals: deque[float] = field(default_factory=deque)
    first_dispatch: float | None = None
    last_arrival: float | None = None
    failed_at: float | None = None
    """When a send to the region's cluster last failed: no credit for one window after it."""
    latencies: deque[tuple[float, float]] = field(default_factory=deque)
    """(arrived_at, dispatch-to-arrival seconds) within the window."""
    nodes: dict[str, tuple[bool, float, float]] = field(default_factory=dict)
    """node -> (serving, tokens_per_s, received_at); serving: `up` with an engine up."""
    capacity: dict[str, float] = field(default_factory=dict)
    """node -> tokens/s its engines deliver while busy (0: not measured yet)."""
    lost: deque[float] = field(default_factory=deque)
    """When each of its groups was lost within the window (re-sent from scratch, a duplicate, stale)."""
    usd_per_s: float = 0.0
    """What its live nodes cost per second now (price-aware placement)."""
    transfer_usd_per_group: float = 0.0
    """What a group's bytes cost on its link."""


class RegionCredits:
    def __init__(self, weights: dict[str, float], *, window_s: float, tokens_per_group: float,
                 by_capacity: bool = False, price_aware: bool = False, horizon_s: float | None = None,
                 max_staleness: int = 0) -> None:
        self.window_s, self._tokens_bound = window_s, max(tokens_per_group, 1.0)
        self.by_capacity = by_capacity
        """Split by capacity (sync mode) instead of by expected return (see the module docstring)."""
        self.price_aware, self._horizon_s, self.max_staleness = price_aware, horizon_s, max_staleness
        """Fill the cheapest capacity per useful group first (see the module docstring)."""
        self.regions = {name: _Region(w) for name, w in weights.items()}
        self._tokens_seen: float | None = None
        self._last_step: float | None = None
        self._step_interval_s: float | None = None

    @property
    def tokens_per_group(self) -> float:
        """Tokens of a group: the configured bound until groups arrive, then their moving mean."""
        return self._tokens_bound if self._tokens_seen is None else max(self._tokens_seen, 1.0)

    def on_dispatch(self, region: str, now: float) -> None:
        r = self.regions[region]
        if r.first_dispatch is None:
            r.first_dispatch = now

    def on_arrival(self, region: str, now: float, latency_s: float | None = None,
                   tokens: int | None = None) -> None:
        """A group arrived from `region`: `latency_s` since its dispatch, `tokens` its completion tokens
        (they teach the credits a group's real size, for turning tokens/s into groups/s)."""
        if tokens is not None and tokens > 0:
            self._tokens_seen = (tokens if self._tokens_seen is None
                                 else (1 - _TOKENS_ALPHA) * self._tokens_seen + _TOKENS_ALPHA * tokens)
        r = self.regions.get(region)
        if r is None:
            return
        r.arrivals.append(now)
        r.last_arrival = now
        if latency_s is not None:
            r.latencies.append((now, max(latency_s, 0.0)))

    def on_lost(self, region: str, now: float) -> None:
        """A group of `region` was lost: sent again from scratch, or it arrived a duplicate or stale."""
        r = self.regions.get(region)
        if r is not None:
            r.lost.append(now)

    def on_step(self, now: float) -> None:
        """The learner finished a step: the horizon of price-aware placement follows the step interval."""
        if self._last_step is not None:
            gap = max(now - self._last_step, 0.0)
            prev = self._step_interval_s
            self._step_interval_s = gap if prev is None else 0.8 * prev + 0.2 * gap
        self._last_step = now

    def set_spend(self, region: str, usd_per_s: float, transfer_usd_per_group: float = 0.0) -> None:
        """What the region's live nodes cost per second now, and a group's bytes on its link (cost.py)."""
        r = self.regions.get(region)
        if r is not None:
            r.usd_per_s, r.transfer_usd_per_group = max(usd_per_s, 0.0), max(transfer_usd_per_group, 0.0)

    def horizon(self) -> float | None:
        """How soon a group placed by price must be expected back (None: no step interval measured yet)."""
        if self._horizon_s is not None:
            return self._horizon_s
        if self._step_interval_s is None:
            return None
        return (1 + self.max_staleness) * self._step_interval_s

    def waste_share(self, region: str, now: float) -> float:
        """Share of the region's groups lost within the window (lost over arrived plus re-sent)."""
        r = self.regions[region]
        while r.lost and r.lost[0] < now - self.window_s:
            r.lost.popleft()
        while r.arrivals and r.arrivals[0] < now - self.window_s:
            r.arrivals.popleft()
        done = len(r.arrivals) + len(r.lost)
        return min(len(r.lost) / done, 1.0) if done else 0.0

    def useful_price(self, region: str, now: float, caps: dict[str, float] | None = None,
                     rates: dict[str, float] | None = None) -> float:
        """US dollars per useful group in `region` now (see the module docstring); inf where the region
        is paid and delivers nothing useful."""
        r = self.regions[region]
        caps = self.capacities(now) if caps is None else caps
        delivered = caps[region] / self.tokens_per_group if r.nodes else (
            self.rates(now) if rates is None else rates)[region]
        useful = delivered * (1.0 - self.waste_share(region, now))
        if r.usd_per_s <= 0:
            return r.transfer_usd_per_group
        return r.usd_per_s / useful + r.transfer_usd_per_group if useful > 0 else float("inf")

    def latency(self, region: str, now: float) -> float:
        """Median dispatch-to-arrival seconds over the window (0 while unmeasured).

        The median, not the mean: the groups a preemption stranded come back (redone by a replacement
        node) many times later than the rest, and a mean inflated by a few of them would starve the
        region of work for a whole window after every preemption."""
        r = self.regions[region]
        while r.latencies and r.latencies[0][0] < now - self.window_s:
            r.latencies.popleft()
        return statistics.median(lat for _, lat in r.latencies) if r.latencies else 0.0

    def on_send_failure(self, region: str, now: float) -> None:
        """The region's cluster refused or timed out a send: treat it as partitioned for a window."""
        self.regions[region].failed_at = now

    def on_heartbeat(self, region: str, node: str, state: str, tokens_per_s: float, now: float,
                     busy_tokens_per_s: float = 0.0, *, serving: bool = True) -> None:
        """`serving`: whether an `up` node has an engine up (`Heartbeat.serving`); False while its
        engines all start or restart, when the node counts as not live."""
        r = self.regions.get(region)
        if r is not None:
            r.nodes[node] = (serving and state == "up", max(float(tokens_per_s), 0.0), now)
            r.capacity[node] = max(float(busy_tokens_per_s), 0.0)

    def rates(self, now: float) -> dict[str, float]:
        """Groups/s per region; None-measured regions get the weighted mean of the measured."""
        measured: dict[str, float] = {}
        for name, r in self.regions.items():
            rate = self._measured(r, now)
            if rate is not None:
                measured[name] = rate
        ref = sum(measured.values()) / len(measured) if measured and any(measured.values()) else 1.0
        return {name: measured.get(name, r.weight * ref) for name, r in self.regions.items()}

    def _measured(self, r: _Region, now: float) -> float | None:
        while r.arrivals and r.arrivals[0] < now - self.window_s:
            r.arrivals.popleft()
        if r.failed_at is not None and now - r.failed_at < self.window_s:
            return 0.0
        beats = [(s, t) for s, t, at in r.nodes.values() if now - at <= self.window_s]
        hb_rate = sum(t for s, t in beats if s) / self.tokens_per_group
        observed = r.first_dispatch is not None and now - r.first_dispatch >= self.window_s
        if not observed and not beats:
            return None
        if beats and not any(s for s, _ in beats):
            return 0.0  # no node serves now: what arrived in the window says nothing of what it can take
        return max(len(r.arrivals) / self.window_s if observed else 0.0, hb_rate)

    def capacities(self, now: float) -> dict[str, float]:
        """Tokens/s per region while its engines have work: the sum over its live nodes (those that
        serve: `up` with an engine up). A live node not measured yet counts as the mean measured node
        times its region's weight, and so does a region that never sent a heartbeat (a fleet without a
        control plane); a region whose nodes are all gone or still starting their engines, or whose
        cluster refused a send within the window, has none."""
        known = [c for r in self.regions.values() for node, c in r.capacity.items()
                 if c > 0 and self._live(r, node, now)]
        ref = sum(known) / len(known) if known else 1.0
        out: dict[str, float] = {}
        for name, r in self.regions.items():
            if r.failed_at is not None and now - r.failed_at < self.window_s:
                out[name] = 0.0
            elif not r.nodes:
                out[name] = r.weight * ref
            else:
                out[name] = sum(r.capacity.get(node, 0.0) or r.weight * ref
                                for node in r.nodes if self._live(r, node, now))
        return out

    def _live(self, r: _Region, node: str, now: float) -> bool:
        serving, _, at = r.nodes[node]
        return serving and now - at <= self.window_s

    def pick(self, in_flight: dict[str, int], now: float, exclude: frozenset[str] = frozenset(),
             work: float = 1.0) -> str:
        """Region for the next group: the earliest expected return (see the module docstring).

        `work`: the group's predicted length over the average (`fleetrl.trainer.lengths`; 1 without
        length-aware placement): a region's latency, measured on average groups, scales with it. With
        `by_capacity` (sync), the region whose share of the work so far is smallest for its capacity."""
        if self.by_capacity:
            return self._pick_by_capacity(in_flight, now, exclude)
        rates = self.rates(now)
        candidates = [n for n in self.regions if n not in exclude and rates[n] > 0] or [
            n for n in self.regions if n not in exclude
        ] or list(self.regions)
        if all(rates[n] <= 0 for n in candidates):
            rates = {n: self.regions[n].weight for n in self.regions}

        caps = self.capacities(now)

        def expected_return_s(n: str) -> tuple[float, str]:
            held = in_flight.get(n, 0)
            latency = self.latency(n, now) * work
            if held <= 0 and self._has_live_nodes(self.regions[n], now):
                # Idle with live nodes: it can start at once. Without this probe a region that got
                # no work (after a drain, say) reports no throughput and never gets work again.
                return latency, n
            # Its backlog drains at what it returned, or at what its engines deliver while busy if
            # more: a region given little returns little, and would look slow by its arrivals alone.
            drain = max(rates[n], caps[n] / self.tokens_per_group if self.regions[n].nodes else 0.0)
            backlog = (held + 1) / max(drain, 1e-9)
            return max(latency, backlog), n

        returns = {n: expected_return_s(n) for n in candidates}
        horizon = self.horizon() if self.price_aware else None
        if horizon is not None:
            in_time = [n for n in candidates if returns[n][0] <= horizon]
            if in_time:  # the cheapest useful group among those back in time; else the earliest return
                return min(in_time, key=lambda n: (self.useful_price(n, now, caps, rates), returns[n]))
        return min(candidates, key=lambda n: returns[n])

    def _pick_by_capacity(self, in_flight: dict[str, int], now: float, exclude: frozenset[str]) -> str:
        """The region whose share stays smallest for its capacity with one more group: `(held + 1) /
        capacity`, which fills regions in proportion to capacity (the makespan-even split)."""
        caps = self.capacities(now)
        allowed = [n for n in self.regions if n not in exclude] or list(self.regions)
        candidates = [n for n in allowed if caps[n] > 0]
        if not candidates:  # nothing measured alive: fall back on the configured weights
            candidates, caps = allowed, {n: self.regions[n].weight for n in self.regions}
        return min(candidates, key=lambda n: (in_flight.get(n, 0) + 1) / caps[n])

    def _has_live_nodes(self, r: _Region, now: float) -> bool:
        return any(serving and now - at <= self.window_s for serving, _, at in r.nodes.values())

    def silent_since(self, region: str) -> float | None:
        """When the region last proved it returns work (its last arrival, else its first dispatch)."""
        r = self.regions.get(region)
        if r is None:
            return None
        return r.last_arrival if r.last_arrival is not None else r.first_dispatch

    def state(self) -> dict[str, Any]:
        return {n: {"weight": r.weight} for n, r in self.regions.items()}
