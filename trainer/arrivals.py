"""What the trainer does with each group that arrives on a region's `trajectories` (DESIGN.md §1, §3).

A delivery is one of:

* an evaluation's group of this run: to the eval books (`eval_runner.py`), never trained;
* a group of another run: dead-lettered (`wrong_run`) through the region's own producer;
* a duplicate of a group already resolved: counted as the region's lost work (`group.duplicate`);
* a group for the collector: credited to its region (arrival rate, latency, tokens), its length fed
  to the dispatcher's length estimate, resolved in the dispatcher, the agent tokens its worker could
  not replay (`regenerated`) counted as waste; a stale one (past `max_staleness`) is dropped and
  counted as lost (`group.stale`).

Every delivery is then marked handled in `RegionClients`: its offset is committed once a checkpoint
covers it. The service (`service.py`) calls `handle` with each poll's deliveries and the current
step and version.
"""

from __future__ import annotations

import time
from typing import Any

from fleetrl.broker import GroupRecord, RecordError, encode_record
from fleetrl.config import FleetConfig
from fleetrl.log import get_logger
from fleetrl.trainer.collector import Collector
from fleetrl.trainer.cost import CostMeter
from fleetrl.trainer.credits import RegionCredits
from fleetrl.trainer.dispatcher import Dispatcher
from fleetrl.trainer.eval_runner import EvalRunner
from fleetrl.trainer.metrics import TrainerMetrics
from fleetrl.trainer.regions import RegionClients
from fleetrl.trainer.round_trips import RoundTrips

log = get_logger(__name__)


class Arrivals:
    def __init__(self, config: FleetConfig, collector: Collector, dispatcher: Dispatcher, credits: RegionCredits,
                 cost: CostMeter, metrics: TrainerMetrics, evals: EvalRunner, round_trips: RoundTrips) -> None:
        self.config, self.collector, self.dispatcher, self.credits = config, collector, dispatcher, credits
        self.cost, self.metrics, self.evals, self.round_trips = cost, metrics, evals, round_trips
        self.clients: RegionClients | None = None
        """Set once the trainer's Kafka clients are up (`service.Trainer.run`)."""
        self.version_at: dict[int, float] = {}
        """When each recent version became the newest: a group sent ahead for it could start then."""

    def on_version(self, version: int) -> None:
        self.version_at[version] = time.time()
        self.version_at.pop(version - 64, None)  # (groups ask at most `dispatch_ahead_steps` ahead)

    async def handle(self, polled: dict[str, list[Any]], step: int, version: int) -> None:
        for region, deliveries in polled.items():
            for d in deliveries:
                await self.on_group(region, d, step, version)

    async def on_group(self, region: str, delivery: Any, step: int, version: int) -> None:
        record = delivery.record
        assert isinstance(record, GroupRecord) and self.clients is not None
        if record.eval is not None and record.run == self.config.run:
            self.evals.on_group(record, step)  # never trained: the eval's own books
            self.clients.handled(region, delivery)
            return
        now = time.time()
        flight = self.dispatcher.in_flight.get(record.group_id)
        latency = None
        if flight is not None and flight.region == region:
            # From when it could start: a group sent ahead waited for its version, not for the region.
            latency = now - max(flight.dispatched_at, self.version_at.get(flight.min_version, 0.0))
        self.credits.on_arrival(region, now, latency, tokens=sum(len(smp.completion_ids) for smp in record.samples))
        self.cost.on_transfer(region, delivery.size)
        if record.samples:
            self.dispatcher.observe_lengths(record.group_id, sum(len(s.completion_ids) for s in record.samples)
                                            / len(record.samples))
        verdict = self.collector.offer(record, version)
        if verdict == "foreign":
            err = RecordError("wrong_run", f"record of run {record.run!r} in run {self.config.run!r}'s topic",
                              field="run", group_id=record.group_id)
            await self.clients.producer(region).dead_letter(
                (delivery.key or "").encode(), encode_record(record), err,
                delivery.topic, delivery.partition, delivery.offset)
            self.metrics.foreign.labels(region).inc()
        elif verdict == "duplicate":
            self.metrics.duplicates.labels(region).inc()
            self.lost(region, record)
            log.info("group.duplicate", group_id=record.group_id, attempt=record.attempt, region=region)
        else:
            self.metrics.groups.labels(region).inc()
            if flight is not None and latency is not None:
                self.round_trips.observe(region, flight.dispatched_at, record.timings, now)
            self.dispatcher.resolve(record.group_id)
            self.cost.on_unreplayed(region, record.regenerated or {})
            if verdict == "stale":
                self.count_stale(region, record, version)
        self.clients.handled(region, delivery)

    def lost(self, region: str, record: GroupRecord) -> None:
        """The region's work on this group was paid for and is not trained (a duplicate, or stale)."""
        self.credits.on_lost(region, time.time())
        self.cost.on_regenerated(region, sum(len(smp.completion_ids) for smp in record.samples))

    def count_dead_letter(self, region: str, reason: str) -> None:
        self.metrics.dead_lettered.labels(region, reason).inc()

    def count_stale(self, region: str, record: GroupRecord, version: int) -> None:
        self.metrics.stale_dropped.labels(region).inc()
        self.lost(region, record)
        log.warning("group.stale", group_id=record.group_id, region=region,
                    lag=self.collector.lag(record, version), bound=self.collector.max_lag)
