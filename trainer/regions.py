"""The trainer's Kafka clients: one producer and one `trajectories` consumer per region cluster.

The trainer is the hub of the star (DESIGN.md §1): there is no cross-cluster mirroring, just a
client pair per region. Each consumer is positioned at the offsets of the newest checkpoint (exact
resume) and dead-letters malformed records through its own region's producer. Deliveries the trainer
has acted on are kept here until a checkpoint covers them; only then are they committed.
"""

from __future__ import annotations

import asyncio
from contextlib import AsyncExitStack
from types import TracebackType
from typing import Any

from fleetrl.broker import Consumer, Delivery, Producer, RecordLimits
from fleetrl.config import FleetConfig
from fleetrl.log import get_logger

log = get_logger(__name__)


class RegionClients:
    def __init__(self, config: FleetConfig, limits: RecordLimits, group: str,
                 offsets: dict[str, dict[tuple[str, int], int]]) -> None:
        self.config, self.limits, self.group, self.start_offsets = config, limits, group, offsets
        self.producers: dict[str, Producer] = {}
        self.consumers: dict[str, Consumer] = {}
        self._handled: dict[str, list[Delivery]] = {r.name: [] for r in config.regions}
        self._stack = AsyncExitStack()

    async def __aenter__(self) -> RegionClients:
        run = self.config.run
        try:
            for r in self.config.regions:
                p = Producer(self.config, r.name, f"{run}-trainer-{r.name}")
                self.producers[r.name] = await self._stack.enter_async_context(p)
                c = Consumer(self.config, r.name, ["trajectories"], self.group, self.limits, p,
                             f"{run}-trainer-{r.name}")
                self.consumers[r.name] = await self._stack.enter_async_context(c)
                if self.start_offsets.get(r.name):
                    c.seek(dict(self.start_offsets[r.name]))
        except BaseException:
            await self._stack.aclose()
            raise
        log.info("trainer.clients_ready", regions=list(self.consumers))
        return self

    async def __aexit__(self, et: type[BaseException] | None, e: BaseException | None,
                        tb: TracebackType | None) -> None:
        await self._stack.aclose()

    async def poll(self, max_records: int, timeout_s: float) -> dict[str, list[Delivery]]:
        """Poll every region at once; a region that fails is logged and skipped this round."""
        names = list(self.consumers)
        results = await asyncio.gather(
            *(self.consumers[n].poll(max_records, timeout_s) for n in names), return_exceptions=True)
        out: dict[str, list[Delivery]] = {}
        for name, result in zip(names, results, strict=True):
            if isinstance(result, BaseException):
                if not getattr(result, "retriable", False):
                    raise result
                log.warning("trainer.poll_failed", region=name, error=str(result))
                continue
            out[name] = result
        return out

    def handled(self, region: str, delivery: Delivery) -> None:
        self._handled[region].append(delivery)

    def take_handled(self) -> dict[str, list[Delivery]]:
        taken, self._handled = self._handled, {r: [] for r in self._handled}
        return taken

    async def commit(self, covered: dict[str, list[Any]]) -> None:
        """Commit what a durable checkpoint covers (a failed commit only means re-reading later)."""
        for region, deliveries in covered.items():
            try:
                await self.consumers[region].commit(deliveries)
            except Exception as exc:  # the checkpoint holds the offsets; Kafka's copy may lag behind
                log.warning("trainer.commit_failed", region=region, error=str(exc))
