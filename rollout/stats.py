"""The rollout worker's counters and the stats it reports (heartbeats, the region agent, logs).

`WorkerCounters` is one plain record that the worker's parts (intake, job queue, publisher,
episodes, handover) each add to; `WorkerStats` reads it with the engine's own figures into the
dict that `RolloutWorker.stats()` returns, and logs it every `rollout.stats_interval_s`. The
decoding rate covers the last `RATE_WINDOW_S` seconds only, so a worker that sat idle (drained,
starved) reports what it does now, not its lifetime mean (region credits read it).
"""

from __future__ import annotations

import time
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from fleetrl.log import get_logger
from fleetrl.rollout.engine import Engine
from fleetrl.rollout.region_history import RegionHistory
from fleetrl.rollout.rewards import Rewards
from fleetrl.rollout.weights import WeightSync

log = get_logger(__name__)
RATE_WINDOW_S = 30.0


@dataclass(slots=True)
class WorkerCounters:
    groups_done: int = 0
    groups_handed_over: int = 0
    tokens_generated: int = 0
    episodes_failed: int = 0
    """Episodes that ended on an environment error with the failure reward (`env.on_error`)."""
    episode_tokens_discarded: int = 0
    """Tokens of episodes handed over unfinished: they are generated again where the episode restarts."""
    redelivered: int = 0
    """Records delivered again after a rebalance while this worker still held them (not work twice)."""
    polls_cancelled: int = 0
    """Polls cut short by a preemption (their records stay in Kafka for the partition's next owner)."""
    agent_samples: int = 0
    """Samples of agent runs (`openai_agent`) published."""
    agent_samples_resegmented: int = 0
    """Of those, samples of more than one segment (a call that did not extend the run's context)."""
    agent_calls_replayed: int = 0
    """Calls of agent runs handed over to this worker answered from their capture (rollout/agent_replay.py)."""
    agent_tokens_replayed: int = 0
    """Their policy tokens: carried over, not generated again."""
    agent_tokens_regenerated: int = 0
    """Policy tokens of handed-over captures that could not be replayed (generated again: waste)."""
    engine_steps: int = 0
    """Decoding steps taken: the region agent's hang check watches it move while there is work."""
    engine_busy_s: float = 0.0
    """Seconds spent in engine steps (decoding, applying weights): the rest of the worker's life
    the engine was idle (no work, waiting for a version, or starting)."""
    handed_over_by_reason: Counter[str] = field(default_factory=Counter)
    """Groups handed back as partials, by the reason each carries in `handed_over_by`."""
    dead_lettered: Counter[str] = field(default_factory=Counter)
    """Records this worker sent to the dead-letter topic, by reason (bad prompts, failed rewards)."""

    def count_dead_letter(self, reason: str) -> None:
        """The producer's `on_dead_letter` hook."""
        self.dead_lettered[reason] += 1


class WorkerStats:
    """The stats dict of one worker, from its counters and its engine; `in_flight` counts admitted groups."""

    def __init__(self, counters: WorkerCounters, engine: Engine, weights: WeightSync, rewards: Rewards,
                 region_history: RegionHistory | None, in_flight: Callable[[], int], interval_s: float) -> None:
        self.counters, self.engine, self.weights, self.rewards = counters, engine, weights, rewards
        self.region_history, self._in_flight, self._interval_s = region_history, in_flight, interval_s
        self.started = self._last_log = time.monotonic()
        # (time, engine.tokens_sampled) samples: the reported rate covers the recent window only
        self._rate_samples: deque[tuple[float, int]] = deque([(self.started, engine.tokens_sampled)])

    def uptime_s(self) -> float:
        return time.monotonic() - self.started

    def stats(self) -> dict[str, Any]:
        c, engine = self.counters, self.engine
        in_flight = sum(engine.tokens_so_far(g) for g in engine.group_ids())
        return {"groups_done": c.groups_done, "episodes_failed": c.episodes_failed,
                "episode_tokens_discarded": c.episode_tokens_discarded, "handed_over": c.groups_handed_over,
                "dead_lettered": dict(c.dead_lettered),
                **({"agent_samples": c.agent_samples, "agent_samples_resegmented": c.agent_samples_resegmented,
                    "agent_calls_replayed": c.agent_calls_replayed, "agent_tokens_replayed": c.agent_tokens_replayed,
                    "agent_tokens_regenerated": c.agent_tokens_regenerated}
                   if c.agent_samples else {}),
                "groups_in_flight": self._in_flight(), "tokens_in_flight": in_flight,
                "tokens_per_s": round(self._recent_tokens_per_s(), 2), "version": engine.version,
                "busy_tokens_per_s": round(engine.tokens_sampled / c.engine_busy_s, 2)
                if c.engine_busy_s > 0 else 0.0,
                "weights": self.weights.have,
                "rewards": {name: st.as_dict() for name, st in self.rewards.stats.items()},
                "engine_steps": c.engine_steps, "busy": engine.has_work(),
                **self._region_stats(),
                "engine_busy_s": round(c.engine_busy_s, 3), "tokens_sampled": engine.tokens_sampled,
                "uptime_s": round(self.uptime_s(), 3)}

    def _region_stats(self) -> dict[str, Any]:
        """The region history's counters (zero without it): answers recorded, records skipped as bad."""
        feed = self.region_history.stats if self.region_history is not None else None
        return {"region_responses": self.engine.responses_observed,
                "region_responses_dropped": self.engine.responses_dropped,
                "region_records": feed.records if feed is not None else 0,
                "region_own": feed.own if feed is not None else 0,
                "region_skipped": feed.skipped if feed is not None else 0}

    def _recent_tokens_per_s(self) -> float:
        """Tokens sampled per second over about the last RATE_WINDOW_S seconds."""
        now, total = time.monotonic(), self.engine.tokens_sampled
        samples = self._rate_samples
        samples.append((now, total))
        while len(samples) > 2 and now - samples[1][0] >= RATE_WINDOW_S:
            samples.popleft()
        t0, n0 = samples[0]
        return (total - n0) / max(now - t0, 1e-9)

    def maybe_log(self) -> None:
        if time.monotonic() - self._last_log >= self._interval_s:
            self.log_now()

    def log_now(self, **extra: Any) -> None:
        """`worker.stats` now (the stopping worker's last one, whatever the interval left)."""
        self._last_log = time.monotonic()
        log.info("worker.stats", **self.stats(), **extra)
