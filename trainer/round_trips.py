"""Where a group's round trip goes: four phases, from the trainer's dispatch to the group's arrival.

A group record carries the worker's clock at three points (`Timings`: received, started, finished);
the trainer adds its own at both ends (the dispatch, the arrival). The phases:

* `to_worker`: dispatch to the worker's receipt (the send, the link out, Kafka, the worker's fetch);
* `wait`: receipt to the engine's start (the worker waits for the prompt's `min_version` weights to
  land, and for room under `rollout.max_groups_in_flight`);
* `generate`: the engine's start to the finished, scored group (queueing for slots included);
* `back`: the finished group to the trainer's hands (the send, the link back, the trainer's fetch).

The phases cross clocks (the trainer's and a region's), so a skew between them moves time from one
phase to its neighbour; on one machine (the benchmarks) they are exact. They are observed into
`fleetrl_trainer_group_round_trip_seconds{region,phase}` (its quantiles for operators) and, per step,
as the means over the groups that arrived since the previous step (`summary`, on the `step.done` log
line): means, because they add up, and with the arrival rate give the work in flight (Little's law),
which a median hides when a long tail holds places in the admission window.
"""

from __future__ import annotations

import statistics

from fleetrl.broker import Timings
from fleetrl.trainer.metrics import TrainerMetrics

PHASES = ("to_worker", "wait", "generate", "back")


def phases(dispatched_at: float, timings: Timings, arrived: float) -> tuple[float, float, float, float] | None:
    """The four phases of one round trip, or None where the worker's record did not time them."""
    if not (timings.queued and timings.started and timings.finished):
        return None
    return (timings.queued - dispatched_at, timings.started - timings.queued,
            timings.finished - timings.started, arrived - timings.finished)


class RoundTrips:
    """Phases of the groups that arrived since the last `summary`."""

    def __init__(self, metrics: TrainerMetrics) -> None:
        self.metrics = metrics
        self._since: list[tuple[float, float, float, float]] = []

    def observe(self, region: str, dispatched_at: float, timings: Timings, arrived: float) -> None:
        got = phases(dispatched_at, timings, arrived)
        if got is None:
            return
        self._since.append(got)
        for name, seconds in zip(PHASES, got, strict=True):
            self.metrics.round_trip.labels(region, name).observe(max(seconds, 0.0))

    def summary(self) -> dict[str, float]:
        """`rt_<phase>`: each phase's mean over the groups since the last call (none: nothing), in
        seconds; then starts over."""
        got, self._since = self._since, []
        if not got:
            return {}
        columns = zip(*got, strict=True)
        return {f"rt_{name}": round(statistics.fmean(col), 4) for name, col in zip(PHASES, columns, strict=True)}
