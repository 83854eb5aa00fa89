"""Prometheus metrics of a region agent (units in the names) on their own registry.

Served on `rollout.metrics_port` (0 picks a free port, logged as `agent.metrics`; None disables).
They are refreshed with every heartbeat, from the same figures the heartbeat carries.
"""

from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge

from fleetrl.metrics import MetricsRegistry

STATES = ("up", "draining", "offline")


class AgentMetrics(MetricsRegistry):
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        super().__init__(registry)
        r = self.registry
        self.state = Gauge("fleetrl_agent_state", "1 for the node's current state, 0 for the others", ["state"],
                           registry=r)
        self.version = Gauge("fleetrl_rollout_policy_version", "Policy version the engine holds (-1: none yet)",
                             registry=r)
        self.tokens_per_s = Gauge("fleetrl_rollout_tokens_per_second", "Decoding rate of the current worker",
                                  registry=r)
        self.in_flight = Gauge("fleetrl_rollout_groups_in_flight", "Groups admitted and not yet handed to a record",
                               registry=r)
        # Counters (names end _total): the agent knows their running totals and adds the difference.
        self.groups_done = Counter("fleetrl_rollout_groups_done_total", "Finished groups produced by this agent",
                                   registry=r)
        self.handed_over = Counter("fleetrl_rollout_groups_handed_over_total",
                                   "Unfinished groups handed over as partials by this agent", registry=r)
        self.workers = Counter("fleetrl_agent_workers_started_total", "Rollout workers started (1 + resumes)",
                               registry=r)
        self._totals = {"done": 0, "handed_over": 0, "workers": 0}

    def update(self, state: str, version: int | None, stats: dict[str, Any], done: int, handed_over: int,
               workers: int) -> None:
        for s in STATES:
            self.state.labels(s).set(1.0 if s == state else 0.0)
        self.version.set(-1 if version is None else version)
        self.tokens_per_s.set(float(stats.get("tokens_per_s", 0.0)) if state == "up" else 0.0)
        self.in_flight.set(float(stats.get("groups_in_flight", 0)))
        for name, counter, total in (("done", self.groups_done, done), ("handed_over", self.handed_over, handed_over),
                                     ("workers", self.workers, workers)):
            if total > self._totals[name]:
                counter.inc(total - self._totals[name])
                self._totals[name] = total
