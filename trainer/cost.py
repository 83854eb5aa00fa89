"""What the fleet costs, measured from the heartbeats the trainer already receives (docs/cost.md).

Every node's agent sends a retained heartbeat every `mqtt.heartbeat_interval_s` and on every change
(DESIGN.md §4): its state, its capacity type (`on_demand` or `spot`), whether an engine serves, and
the tokens its engines sampled since its agent started (`started_at`). A node first heard of while
it runs is paid from that start (as loading: its serving time is counted from heartbeats on);
between two heartbeats of one node the node existed, so that time is paid: `CostMeter.observe` adds
`ts - previous ts` (the node's own clock, so other machines' clocks do not matter) to the node-
seconds of its (region, capacity) when the earlier heartbeat was not `offline`, and to its serving
node-seconds when an engine was up then. Node-seconds times the pool's price (`prices.PriceBook`)
are dollars. A node that goes silent accrues nothing until it speaks again, and then its whole gap
(it was running, and billed, all along). An `offline` with `left` (the agent's farewell) is paid up to
it; a last will (`offline` without `left`: its `ts` is when the agent connected) pays nothing, and if
the same agent (`started_at`) speaks again the whole gap is paid, while a new agent under the old
name is paid from its own start.

What the money bought is counted where it was paid for:

* tokens sampled: the growth of each node's `tokens_sampled` (a restarted agent starts again at 0);
* groups trained, with their tokens: the region that produced each group;
* waste from preemption, by the region that lost the work: groups re-sent (a gone or silent region's
  groups dispatched again from scratch, partials too stale to move) and tokens regenerated (known
  exactly where the trainer holds them: duplicate and stale arrivals, partials it could not use, and
  the tokens of a handed-over agent capture that the receiving worker could not replay, which its
  group record names).
  Tokens lost with a worker killed before it handed over are in no record; they show as tokens
  sampled that never reached training (the demo summary and `bench/pipeline.py --cost` report that
  share, `waste_share`).

`usd(now)` is the spend so far, the time since each live node's last heartbeat included (at most two
heartbeat intervals: past that a node is silent), so a step shorter than a heartbeat interval still
has its cost; the next heartbeat replaces the estimate with the measured interval. The totals and each
node's last heartbeat go into the checkpoint: a restarted trainer accrues the time it was down from
the nodes' next heartbeats.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from fleetrl.broker import Heartbeat
from fleetrl.config import Capacity, FleetConfig
from fleetrl.trainer.credits import RegionCredits
from fleetrl.trainer.metrics import TrainerMetrics
from fleetrl.trainer.prices import CAPACITIES, PriceBook

Pool = tuple[str, Capacity]
"""(region, capacity type): the unit the cost is counted and reported in."""
_PRUNE_OFFLINE_S = 3600.0  # a node offline this long is forgotten (its heartbeat, if retained, is a baseline)


@dataclass(slots=True)
class _Node:
    capacity: Capacity
    ts: float
    """The node's clock at its last heartbeat that counted (a last will's does not: see `observe`)."""
    state: str
    serving: bool
    tokens: int
    started_at: float | None = None
    """Its agent's start: an agent that comes back after a last will is the same one if it matches."""
    gone: bool = False
    """An `offline` was heard: its own farewell (`left`, paid to then), or a last will."""


@dataclass(slots=True)
class PoolCost:
    """The totals of one (region, capacity)."""

    node_s: float = 0.0
    """Node-seconds paid."""
    serving_s: float = 0.0
    """Of which a node had an engine up (the rest: engines loading, restarting; draining nodes)."""
    usd: float = 0.0
    tokens_sampled: int = 0


class CostMeter:
    def __init__(self, config: FleetConfig, prices: PriceBook, metrics: TrainerMetrics | None = None) -> None:
        self.config, self.prices, self.metrics = config, prices, metrics
        self._defaults = {r.name: r for r in config.regions}
        self.max_gap_s = 2.0 * config.mqtt.heartbeat_interval_s
        self.nodes: dict[tuple[str, str], _Node] = {}
        self.pools: dict[Pool, PoolCost] = defaultdict(PoolCost)
        self.transfer_usd: dict[str, float] = defaultdict(float)
        self.transfer_bytes: dict[str, int] = defaultdict(int)
        self.trained_groups: dict[str, int] = defaultdict(int)
        self.trained_tokens: dict[str, int] = defaultdict(int)
        self.groups_resent: dict[str, int] = defaultdict(int)
        self.tokens_regenerated: dict[str, int] = defaultdict(int)
        self._arrivals: dict[str, int] = defaultdict(int)
        self._step_usd = 0.0
        """Spend at the end of the previous step (`step_fields`)."""

    # -- time paid, from heartbeats -------------------------------------------------------------

    def observe(self, region: str, node: str, hb: Heartbeat) -> None:
        """A node's heartbeat (the same one seen again changes nothing).

        An `offline` with `left` is the agent's farewell: paid up to it. An `offline` without it is a
        last will, whose `ts` is when the agent connected: the node may have died any time since its
        last beat, or only lost its MQTT connection (a busy broker, a partition). Nothing is paid for
        it; if the same agent (`started_at`) speaks again, it ran all along and the whole gap is paid,
        and a new agent under the name is paid from its own start."""
        r = self._defaults.get(region)
        if r is None:
            return
        known = self.nodes.get((region, node))
        now = _Node(hb.capacity or r.node_capacity(node), hb.ts, hb.state, hb.serving, hb.tokens_sampled,
                    hb.started_at, gone=hb.state == "offline")
        if known is not None and hb.ts == known.ts and hb.state == known.state:
            return
        if hb.state == "offline":
            if known is not None and not known.gone and hb.left:
                self._since(region, known, hb.ts, hb.tokens_sampled)
            if known is None or hb.left:
                self.nodes[(region, node)] = now
            elif not known.gone:
                known.gone = True  # a last will: keep the last beat, in case the same agent comes back
            return
        self.nodes[(region, node)] = now
        same = known is not None and (not known.gone or (hb.started_at is not None
                                                         and hb.started_at == known.started_at))
        if known is not None and same:
            self._since(region, known, hb.ts, hb.tokens_sampled)
        elif hb.started_at is not None and hb.started_at <= hb.ts:
            # First heard of while it runs (or a new agent under an old name): paid since its agent
            # started, as loading as far as we know; its tokens count from its start.
            self._accrue((region, now.capacity), hb.ts - hb.started_at, False, hb.tokens_sampled)
        # else a baseline (an agent that does not say when it started): what came before is not ours

    def _since(self, region: str, known: _Node, ts: float, tokens: int) -> None:
        """Pay the time from `known`'s beat to `ts` at its capacity, with the tokens sampled meanwhile."""
        grew = tokens - known.tokens if tokens >= known.tokens else tokens  # (fewer: a restarted agent)
        self._accrue((region, known.capacity), max(0.0, ts - known.ts), known.serving, grew)

    def _accrue(self, pool: Pool, seconds: float, serving: bool, tokens: int) -> None:
        p = self.pools[pool]
        usd = seconds * self.prices.usd_per_node_hour(*pool) / 3600.0
        p.node_s += seconds
        p.serving_s += seconds if serving else 0.0
        p.usd += usd
        p.tokens_sampled += max(tokens, 0)
        if self.metrics is not None:
            self.metrics.cost_usd.labels(*pool).inc(usd)
            self.metrics.cost_node_seconds.labels(*pool).inc(seconds)
            self.metrics.cost_tokens_sampled.labels(*pool).inc(max(tokens, 0))

    def live(self, now: float) -> dict[Pool, int]:
        """Nodes paid now per pool: not offline, heard from within two heartbeat intervals."""
        out: dict[Pool, int] = defaultdict(int)
        for (region, _), n in self.nodes.items():
            if not n.gone and now - n.ts <= self.max_gap_s:
                out[(region, n.capacity)] += 1
        return out

    def usd_per_s(self, now: float) -> dict[str, float]:
        """What each region's live nodes cost per second now (its spend rate)."""
        out: dict[str, float] = {r: 0.0 for r in self._defaults}
        for (region, capacity), count in self.live(now).items():
            out[region] += count * self.prices.usd_per_node_hour(region, capacity) / 3600.0
        return out

    def prune(self, now: float) -> None:
        for key, n in list(self.nodes.items()):
            if n.gone and now - n.ts > _PRUNE_OFFLINE_S:
                del self.nodes[key]

    # -- what it bought, and what was lost ---------------------------------------------------

    def on_transfer(self, region: str, nbytes: int) -> None:
        """Bytes crossed the region's link (a trajectory fetched): priced at its `transfer_usd_per_gb`."""
        r = self._defaults.get(region)
        if r is None or nbytes <= 0:
            return
        usd = nbytes / 1e9 * r.transfer_usd_per_gb
        self._arrivals[region] += 1
        self.transfer_bytes[region] += nbytes
        self.transfer_usd[region] += usd
        if self.metrics is not None and usd > 0:
            self.metrics.cost_transfer_usd.labels(region).inc(usd)

    def on_trained(self, region: str, tokens: int) -> None:
        self.trained_groups[region] += 1
        self.trained_tokens[region] += tokens

    def on_resent(self, region: str, groups: int = 1) -> None:
        """Groups of `region` sent again from scratch: what it had made of them is lost."""
        if groups > 0:
            self.groups_resent[region] += groups
            if self.metrics is not None:
                self.metrics.cost_groups_resent.labels(region).inc(groups)

    def on_regenerated(self, region: str, tokens: int) -> None:
        """Tokens `region` sampled that training cannot use (a duplicate, a stale group, a dropped partial)."""
        if tokens > 0:
            self.tokens_regenerated[region] += tokens
            if self.metrics is not None:
                self.metrics.cost_tokens_regenerated.labels(region).inc(tokens)

    def on_unreplayed(self, region: str, regenerated: Mapping[str, int]) -> None:
        """A group from `region` whose worker could not replay part of a handed-over agent capture (the
        record's `regenerated`, docs/agents.md): those tokens were sampled and generated again, waste of the
        region that sampled them (a region the config does not know: `region`)."""
        for lost_in, tokens in regenerated.items():
            self.on_regenerated(lost_in if lost_in in self._defaults else region, tokens)

    def transfer_usd_per_group(self, region: str) -> float:
        n = self._arrivals.get(region, 0)
        return self.transfer_usd.get(region, 0.0) / n if n else 0.0

    def heartbeats(self, nodes: Mapping[tuple[str, str], Heartbeat], credits: RegionCredits, now: float) -> None:
        """Fold in the heartbeats (the control plane's retained view), and tell the credits and the
        gauges what each region costs now."""
        for (region, node), hb in list(nodes.items()):
            self.observe(region, node, hb)
        self.prune(now)
        spend = self.usd_per_s(now)
        for region, usd_per_s in spend.items():
            credits.set_spend(region, usd_per_s, self.transfer_usd_per_group(region))
        if self.metrics is None:
            return
        live = self.live(now)
        for region in spend:
            for capacity in CAPACITIES:
                price = self.prices.usd_per_node_hour(region, capacity)
                self.metrics.cost_price.labels(region, capacity).set(price)
                self.metrics.cost_usd_per_hour.labels(region, capacity).set(live.get((region, capacity), 0) * price)
            if credits.price_aware:
                self.metrics.cost_useful_group_usd.labels(region).set(credits.useful_price(region, now))

    def step_fields(self, now: float, groups: int, tokens: int) -> dict[str, Any]:
        """A step's cost for its log line: what was spent since the previous step, groups and tokens per
        dollar of it, and the running totals (docs/cost.md). Empty when no pool is priced."""
        if not self.prices.priced:
            return {}
        total = self.usd(now)
        step_usd, self._step_usd = max(total - self._step_usd, 0.0), total
        return {"cost_usd": round(step_usd, 6),
                "groups_per_usd": round(groups / step_usd, 3) if step_usd > 0 else None,
                "tokens_per_usd": round(tokens / step_usd, 1) if step_usd > 0 else None,
                **self.summary(now)}

    # -- reading it --------------------------------------------------------------------------

    def usd(self, now: float | None = None) -> float:
        """Dollars spent so far; with `now`, the time since each live node's last heartbeat included."""
        return sum(self.usd_by_pool(now).values()) + sum(self.transfer_usd.values())

    def usd_by_pool(self, now: float | None = None) -> dict[Pool, float]:
        out = {pool: p.usd for pool, p in self.pools.items()}
        if now is not None:
            for (region, _), n in self.nodes.items():
                gap = min(now - n.ts, self.max_gap_s)  # a silent node: at most two intervals, until it speaks
                if not n.gone and gap > 0:
                    pool = (region, n.capacity)
                    out[pool] = out.get(pool, 0.0) + gap * self.prices.usd_per_node_hour(*pool) / 3600.0
        return out

    def usd_by_capacity(self, now: float | None = None) -> dict[Capacity, float]:
        out: dict[Capacity, float] = dict.fromkeys(CAPACITIES, 0.0)
        for (_, capacity), usd in self.usd_by_pool(now).items():
            out[capacity] += usd
        return out

    def summary(self, now: float) -> dict[str, Any]:
        """The totals for a step's log line (`cost_*` fields; docs/cost.md)."""
        by_capacity = self.usd_by_capacity(now)
        return {"cost_usd_total": round(self.usd(now), 6),
                **{f"cost_usd_{c}": round(v, 6) for c, v in by_capacity.items()},
                "node_s_total": round(sum(p.node_s for p in self.pools.values()), 1),
                "serving_s_total": round(sum(p.serving_s for p in self.pools.values()), 1),
                "tokens_sampled_total": sum(p.tokens_sampled for p in self.pools.values()),
                "groups_resent_total": sum(self.groups_resent.values()),
                "tokens_regenerated_total": sum(self.tokens_regenerated.values())}

    # -- checkpoint --------------------------------------------------------------------------

    def state(self) -> dict[str, Any]:
        return {
            "nodes": [[r, n, x.capacity, x.ts, x.state, x.serving, x.tokens, x.started_at]
                      for (r, n), x in self.nodes.items() if not x.gone],
            "pools": [[r, c, p.node_s, p.serving_s, p.usd, p.tokens_sampled] for (r, c), p in self.pools.items()],
            "regions": {name: [self.transfer_usd.get(name, 0.0), self.transfer_bytes.get(name, 0),
                               self.trained_groups.get(name, 0), self.trained_tokens.get(name, 0),
                               self.groups_resent.get(name, 0), self.tokens_regenerated.get(name, 0)]
                        for name in self._defaults},
        }

    def restore(self, state: dict[str, Any]) -> None:
        """Take up the totals of a checkpoint (one written before cost was measured has none)."""
        for r, n, capacity, ts, st, serving, tokens, *started in state.get("nodes", []):
            self.nodes[(r, n)] = _Node(capacity, float(ts), st, bool(serving), int(tokens),
                                       float(started[0]) if started and started[0] is not None else None)
        for r, c, node_s, serving_s, usd, tokens in state.get("pools", []):
            self.pools[(r, c)] = PoolCost(float(node_s), float(serving_s), float(usd), int(tokens))
        for name, row in state.get("regions", {}).items():
            usd, nbytes, groups, tokens, resent, regenerated = row
            self.transfer_usd[name], self.transfer_bytes[name] = float(usd), int(nbytes)
            self.trained_groups[name], self.trained_tokens[name] = int(groups), int(tokens)
            self.groups_resent[name], self.tokens_regenerated[name] = int(resent), int(regenerated)
        self._step_usd = self.usd()
