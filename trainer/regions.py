"""The trainer's Kafka clients: one producer and one `trajectories` consumer per region cluster.

The trainer is the hub of the star (DESIGN.md §1): there is no cross-cluster mirroring, just a
client pair per region. Each consumer is positioned at the offsets of the newest checkpoint (exact
resume) and dead-letters malformed records through its own region's producer. Deliveries the trainer
has acted on are kept here until a checkpoint covers them; only then are they committed.

A region whose cluster cannot be reached when the trainer starts does not stop it: the others are
used, and the missing one is retried in the background every `kafka.request_timeout_s` (its groups
wait in its own Kafka meanwhile; the dispatcher sends it nothing until it is connected). When no region
answers, the trainer waits for the first with backoff, within `trainer.start_timeout_s`, instead of
exiting: a restart during a partition is a transient outage, not a fatal error.

`regions[].emulate_link_delay_s` emulates a slow link between home and a region on one machine: a
prompt is held that long before it is produced, and a fetched trajectory that long before the
trainer sees it (its offset is only committed after it was seen and checkpointed, as any other).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import deque
from collections.abc import Callable
from contextlib import AsyncExitStack
from types import TracebackType
from typing import Any

from fleetrl.broker import Consumer, Delivery, KafkaError, Producer, Record, RecordLimits, Stream
from fleetrl.config import FleetConfig
from fleetrl.log import get_logger

log = get_logger(__name__)


START_BACKOFF_S = 1.0
START_BACKOFF_MAX_S = 15.0
"""Backoff of a starting trainer that no region answers yet: 1, 2, 4, 8, 15, 15 ... s, within
`trainer.start_timeout_s`."""

DeadLetterHook = Callable[[str, str], None]
"""Called with (region, reason) for each record the trainer dead-lettered."""


class RegionClients:
    def __init__(self, config: FleetConfig, limits: RecordLimits, group: str,
                 offsets: dict[str, dict[tuple[str, int], int]], on_dead_letter: DeadLetterHook | None = None) -> None:
        self.config, self.limits, self.group, self.start_offsets = config, limits, group, offsets
        self._on_dead_letter = on_dead_letter
        self.producers: dict[str, Producer] = {}
        self.consumers: dict[str, Consumer] = {}
        self._handled: dict[str, list[Delivery]] = {r.name: [] for r in config.regions}
        self._stacks: dict[str, AsyncExitStack] = {}
        self._reopen: asyncio.Task[None] | None = None
        self.link_delay_s = {r.name: r.emulate_link_delay_s for r in config.regions}
        self._in_transit: dict[str, deque[tuple[float, Delivery]]] = {r.name: deque() for r in config.regions}
        """Per region: (due at, delivery) fetched but not yet across the emulated link, in fetch order."""
        self._polls: dict[str, asyncio.Task[list[Delivery]]] = {}
        """Per region: its poll still in flight (see `poll`)."""

    async def __aenter__(self) -> RegionClients:
        failures = await self._open_first()
        for name, exc in failures.items():
            log.warning("trainer.region_unreachable", region=name, error=str(exc))
        if failures:
            self._reopen = asyncio.create_task(self._reopen_loop(), name="trainer-region-reopen")
        log.info("trainer.clients_ready", regions=list(self.consumers), missing=sorted(failures))
        return self

    async def __aexit__(self, et: type[BaseException] | None, e: BaseException | None,
                        tb: TracebackType | None) -> None:
        await self._close_all()

    async def _open_first(self) -> dict[str, KafkaError]:
        """Open every region's clients; while none answers (a partition, brokers restarting), retry them all
        with backoff, within `trainer.start_timeout_s`, as a restarted unit would. Returns the regions
        still unreachable once at least one answered; raises what is not a KafkaError at once, and a
        KafkaError naming the setting when the bound passes."""
        names = [r.name for r in self.config.regions]
        loop = asyncio.get_running_loop()
        bound_s = self.config.trainer.start_timeout_s
        deadline, delay_s = loop.time() + bound_s, START_BACKOFF_S
        attempt = 0
        while True:
            attempt += 1
            results = await asyncio.gather(*(self._open(n) for n in names), return_exceptions=True)
            failures = {n: r for n, r in zip(names, results, strict=True) if isinstance(r, BaseException)}
            fatal = [exc for exc in failures.values() if not isinstance(exc, KafkaError)]
            if fatal:
                await self._close_all()
                raise fatal[0]
            if len(failures) < len(names):
                return {n: exc for n, exc in failures.items() if isinstance(exc, KafkaError)}
            left_s = deadline - loop.time()
            if left_s <= 0:
                detail = "; ".join(f"{n}: {exc}" for n, exc in failures.items())
                raise KafkaError(f"no region's Kafka answered within trainer.start_timeout_s={bound_s:g} "
                                 f"({attempt} attempts): {detail}") from failures[names[0]]
            wait_s = min(delay_s, left_s)
            log.warning("trainer.waiting_for_regions", attempt=attempt, retry_in_s=round(wait_s, 1),
                        left_s=round(left_s, 1), errors={n: str(exc) for n, exc in failures.items()})
            await asyncio.sleep(wait_s)
            delay_s = min(2 * delay_s, START_BACKOFF_MAX_S)

    async def _open(self, name: str) -> None:
        run = self.config.run
        stack = AsyncExitStack()
        try:
            hook = self._on_dead_letter
            p = await stack.enter_async_context(Producer(
                self.config, name, f"{run}-trainer-{name}",
                on_dead_letter=None if hook is None else (lambda reason: hook(name, reason))))
            c = await stack.enter_async_context(Consumer(self.config, name, ["trajectories"], self.group,
                                                         self.limits, p, f"{run}-trainer-{name}"))
        except BaseException:
            await stack.aclose()
            raise
        if self.start_offsets.get(name):
            c.seek(dict(self.start_offsets[name]))
        self._stacks[name], self.producers[name], self.consumers[name] = stack, p, c

    async def _reopen_loop(self) -> None:
        while missing := [r.name for r in self.config.regions if r.name not in self.consumers]:
            await asyncio.sleep(self.config.kafka.request_timeout_s)
            for name in missing:
                try:
                    await self._open(name)
                    log.info("trainer.region_connected", region=name)
                except KafkaError as exc:
                    log.warning("trainer.region_unreachable", region=name, error=str(exc))

    async def _close_all(self) -> None:
        polls, self._polls = list(self._polls.values()), {}
        for task in polls:  # a cancelled read puts its partitions back (the records are read again)
            task.cancel()
        await asyncio.gather(*polls, return_exceptions=True)
        if self._reopen is not None:
            self._reopen.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._reopen
        for stack in self._stacks.values():
            await stack.aclose()
        self._stacks.clear()

    def producer(self, region: str) -> Producer:
        """The region's producer; a retriable KafkaError while its cluster is not connected."""
        p = self.producers.get(region)
        if p is None:
            raise KafkaError(f"region {region!r}: cluster not connected", retriable=True)
        return p

    async def send(self, region: str, stream: Stream, key: str, record: Record) -> tuple[int, int]:
        """Produce to the region's cluster (after the emulated link delay, where one is set); returns
        the record's (partition, offset)."""
        producer = self.producer(region)
        if self.link_delay_s.get(region):
            await asyncio.sleep(self.link_delay_s[region])
        return await producer.send(stream, key, record)

    async def poll(self, max_records: int, timeout_s: float) -> dict[str, list[Delivery]]:
        """Poll every connected region at once and return as soon as one region's poll is done (records
        arrived, or its `timeout_s` passed): a region waiting for its first record does not hold back
        another region's arrivals. A region's poll still waiting stays in flight and is collected by a
        later call (one read at a time per consumer); a retriable failure skips that region this round.

        Deliveries on an emulated slow link come out once their delay has passed; while some are in
        transit a new poll waits no longer than until the first is due.
        """
        now = time.monotonic()
        due = [q[0][0] for n, q in self._in_transit.items() if q and n in self.consumers]
        if due:
            timeout_s = max(0.0, min(timeout_s, min(due) - now))
        for name, consumer in self.consumers.items():
            if name not in self._polls:
                self._polls[name] = asyncio.create_task(consumer.poll(max_records, timeout_s),
                                                        name=f"trainer-poll-{name}")
        if not self._polls:
            await asyncio.sleep(timeout_s)  # no region connected yet
            return {}
        next_due = max(0.0, min(due) - now) if due else None
        await asyncio.wait(set(self._polls.values()), timeout=next_due, return_when=asyncio.FIRST_COMPLETED)
        out: dict[str, list[Delivery]] = {}
        now = time.monotonic()
        for name, task in list(self._polls.items()):
            if not task.done():
                continue
            del self._polls[name]
            error = task.exception()
            if error is not None:
                if not getattr(error, "retriable", False):
                    raise error
                log.warning("trainer.poll_failed", region=name, error=str(error))
                continue
            out[name] = self._across_link(name, task.result(), now)
        for name in self._in_transit:  # deliveries now due on a link whose region's poll is still out
            if name not in out and self._in_transit[name] and name in self.consumers:
                out[name] = self._across_link(name, [], now)
        return out

    def _across_link(self, region: str, fetched: list[Delivery], now: float) -> list[Delivery]:
        delay = self.link_delay_s.get(region, 0.0)
        if not delay:
            return fetched
        transit = self._in_transit[region]
        transit.extend((now + delay, d) for d in fetched)
        arrived = []
        while transit and transit[0][0] <= now:
            arrived.append(transit.popleft()[1])
        return arrived

    async def lag(self) -> dict[str, int]:
        """Records waiting in each connected region's trajectories topic (regions with no fetch answered
        yet are left out); a retriable failure leaves that region out this round."""
        out: dict[str, int] = {}
        for name, consumer in list(self.consumers.items()):
            try:
                lag = await consumer.lag()
            except KafkaError as exc:
                if not exc.retriable:
                    raise
                log.warning("trainer.lag_failed", region=name, error=str(exc))
                continue
            if lag is not None:
                out[name] = lag
        return out

    def handled(self, region: str, delivery: Delivery) -> None:
        self._handled[region].append(delivery)

    def take_handled(self) -> dict[str, list[Delivery]]:
        taken, self._handled = self._handled, {r: [] for r in self._handled}
        return taken

    async def commit(self, covered: dict[str, list[Any]]) -> None:
        """Commit what a durable checkpoint covers (a failed commit only means re-reading later)."""
        for region, deliveries in covered.items():
            if region not in self.consumers:
                continue
            try:
                await self.consumers[region].commit(deliveries)
            except KafkaError as exc:  # the checkpoint holds the offsets; Kafka's copy may lag behind
                log.warning("trainer.commit_failed", region=region, error=str(exc))
