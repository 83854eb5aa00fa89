"""The trainer's sends of prompts to a region's `prompts` topic: training prompts and eval prompts.

Each send is bounded by `kafka.request_timeout_s` (plus the region's emulated link delay): a
partitioned region costs the loop one request timeout, then the dispatcher skips it; the record may
still land, and a second copy of a prompt is deduplicated downstream. A training prompt is noted in
the collector's ledger (region, partition, offset) once its send is acknowledged; an eval prompt is
counted in the eval books instead (`eval_runner.py`), never in the ledger.
"""

from __future__ import annotations

import asyncio
from typing import Any

from fleetrl.broker import KafkaError
from fleetrl.config import FleetConfig
from fleetrl.crashpoints import crash_point
from fleetrl.trainer.collector import Collector
from fleetrl.trainer.metrics import TrainerMetrics
from fleetrl.trainer.regions import RegionClients


class PromptSends:
    def __init__(self, config: FleetConfig, collector: Collector, metrics: TrainerMetrics) -> None:
        self.config, self.collector, self.metrics = config, collector, metrics
        self.clients: RegionClients | None = None
        """Set once the trainer's Kafka clients are up (`service.Trainer.run`)."""

    async def prompt(self, region: str, record: Any) -> None:
        """A training prompt (the dispatcher's send), noted in the ledger once acknowledged."""
        partition, offset = await self._produce(region, record)
        crash_point("trainer.dispatch.prompt_produced")
        self.collector.note_dispatched(record.group_id, region, partition, offset)
        crash_point("trainer.dispatch.ledger_updated")
        self.metrics.dispatched.labels(region).inc()

    async def eval_prompt(self, region: str, record: Any) -> None:
        """An eval prompt: sent as a training prompt is, counted in the eval books, not the ledger."""
        await self._produce(region, record)

    async def _produce(self, region: str, record: Any) -> tuple[int, int]:
        assert self.clients is not None
        timeout_s = self.config.kafka.request_timeout_s
        try:
            partition, offset = await asyncio.wait_for(
                self.clients.send(region, "prompts", record.group_id, record),
                timeout_s + self.clients.link_delay_s.get(region, 0.0))
        except TimeoutError as exc:
            # The record may still land: a second copy of a prompt is deduplicated downstream.
            raise KafkaError(f"send of {record.group_id} to region {region!r} took over {timeout_s} s",
                             retriable=True) from exc
        return partition, offset
