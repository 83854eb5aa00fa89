"""Prometheus metrics of a region agent (units in the names) on their own registry.

Served with `/healthz` on `rollout.metrics_port` (0 picks a free port, logged as `agent.metrics`;
None disables). They are refreshed with every heartbeat, from the same figures the heartbeat carries,
plus the store requests the node's workers made (what event-driven weight pulls keep small).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge

from fleetrl.broker import Heartbeat
from fleetrl.metrics import MetricsRegistry
from fleetrl.regions.supervisor import DEAD_LETTERED, REWARD_ERRORS, EngineSupervisor

STATES = ("up", "draining", "offline")
ENGINE_STATES = ("starting", "up", "restarting", "crashloop", "stopped")


class AgentMetrics(MetricsRegistry):
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        super().__init__(registry)
        r = self.registry
        self.state = Gauge("fleetrl_agent_state", "1 for the node's current state, 0 for the others", ["state"],
                           registry=r)
        self.engines = Gauge("fleetrl_agent_engines", "The node's engines in each state", ["state"], registry=r)
        self.restarts = Counter("fleetrl_agent_worker_restarts_total", "Worker processes restarted after a crash "
                              "or hang", registry=r)
        self.version = Gauge("fleetrl_rollout_policy_version", "Oldest policy version the node's engines hold "
                             "(-1: none yet)", registry=r)
        self.tokens_per_s = Gauge("fleetrl_rollout_tokens_per_second", "Decoding rate of the node's engines",
                                  registry=r)
        self.in_flight = Gauge("fleetrl_rollout_groups_in_flight", "Groups admitted and not yet handed to a record",
                               registry=r)
        self.groups_done = Counter("fleetrl_rollout_groups_done_total", "Finished groups produced by this agent's "
                                 "workers", registry=r)
        self.handed_over = Counter("fleetrl_rollout_groups_handed_over_total",
                                 "Unfinished groups handed over as partials by this agent's workers", registry=r)
        self.store_requests = Counter("fleetrl_rollout_store_requests_total", "Requests the node's workers made to "
                                    "the region store, by operation", ["op"], registry=r)
        self.dead_lettered = Counter("fleetrl_rollout_dead_lettered_records_total",
                                     "Records this agent's workers sent to the dead-letter topic, by reason "
                                     "(malformed or out-of-bounds prompts, rewards that failed)", ["reason"],
                                     registry=r)
        self.reward_mean = Gauge("fleetrl_rollout_reward_mean", "Mean reward of each custom reward function "
                                 "(`reward.functions`, `url`) over the groups the node's workers scored", ["fn"],
                                 registry=r)
        self.reward_errors = Counter("fleetrl_rollout_reward_errors_total", "Groups a custom reward function "
                                     "failed on (raised, timed out, non-finite or wrong-length result)", ["fn"],
                                     registry=r)
        self.region_responses = Counter("fleetrl_rollout_region_history_responses_total",
                                        "Answers of the region's other workers (read from its trajectories topic) "
                                        "recorded in the response histories of the node's engines", registry=r)
        self.region_skipped = Counter("fleetrl_rollout_region_history_skipped_records_total",
                                      "Records of the region's trajectories topic the node's region histories "
                                      "skipped as unreadable (malformed, out of bounds, another run's)", registry=r)
        self._totals: dict[str, int] = {}

    def update(self, beat: Heartbeat, engines: Sequence[EngineSupervisor]) -> None:
        for s in STATES:
            self.state.labels(s).set(1.0 if s == beat.state else 0.0)
        for s in ENGINE_STATES:
            self.engines.labels(s).set(sum(1 for e in engines if e.state == s))
        self._advance(self.restarts, "restarts", sum(e.restarts for e in engines))
        self.version.set(-1 if beat.version is None else beat.version)
        self.tokens_per_s.set(beat.tokens_per_s)
        self.in_flight.set(beat.in_flight)
        self._advance(self.groups_done, "groups_done", sum(e.totals["groups_done"] for e in engines))
        self._advance(self.handed_over, "handed_over", sum(e.totals["handed_over"] for e in engines))
        self._advance(self.region_responses, "region_responses", sum(e.totals["region_responses"] for e in engines))
        self._advance(self.region_skipped, "region_skipped", sum(e.totals["region_skipped"] for e in engines))
        reasons = {k for e in engines for k in e.totals if k.startswith(DEAD_LETTERED)}
        for key in sorted(reasons):
            self._advance(self.dead_lettered.labels(key.removeprefix(DEAD_LETTERED)), key,
                          sum(e.totals.get(key, 0) for e in engines))
        failed = {k for e in engines for k in e.totals if k.startswith(REWARD_ERRORS)}
        for key in sorted(failed):
            self._advance(self.reward_errors.labels(key.removeprefix(REWARD_ERRORS)), key,
                          sum(e.totals.get(key, 0) for e in engines))
        self._reward_means(engines)
        for op in ("gets", "lists"):
            self._advance(self.store_requests.labels(op.rstrip("s")), op, sum(e.totals[op] for e in engines))

    def _reward_means(self, engines: Sequence[EngineSupervisor]) -> None:
        """Each function's mean over the engines' current workers, weighted by the groups they scored."""
        sums: dict[str, list[float]] = {}
        for e in engines:
            for fn, st in (e.progress.get("rewards") or {}).items():
                acc = sums.setdefault(fn, [0.0, 0.0])
                acc[0] += float(st.get("mean", 0.0)) * int(st.get("groups", 0))
                acc[1] += int(st.get("groups", 0))
        for fn, (total, groups) in sums.items():
            if groups:
                self.reward_mean.labels(fn).set(total / groups)

    def _advance(self, counter: Any, name: str, total: int) -> None:
        """Counters only go up: add what the running total (summed over the engines' workers) gained."""
        if total > self._totals.get(name, 0):
            counter.inc(total - self._totals.get(name, 0))
            self._totals[name] = total
