"""The data-plane consumer: decode, bounds-check, dead-letter, commit only what is durable.

`poll` returns `Delivery`s of records that decoded and passed their schema's bounds. A record that
fails goes to the dead-letter topic with its reason (via the caller's `Producer`), is never
returned and never silently dropped; its offset counts as handled. If the dead letter cannot be
produced, the whole batch is rewound and the error raised, so nothing is skipped.

`commit(deliveries)` is commit-after-effect: the caller passes what is durable (a produced record
acknowledged, a checkpoint written) and the consumer commits one past the highest such offset per
partition (see `fleetrl.broker.offsets`). Offsets are never auto-committed, and closing does not
commit: a consumer that dies before committing leaves its records to the next member of its group.

With `priority=True` the streams are in priority order: while a higher stream (`partials`) has
records waiting, lower ones (`prompts`) are paused and not returned.

The parts: `delivery.py` decodes and checks a fetched batch, `membership.py` holds the group
strategy, the rebalance callbacks and leaving, `positions.py` the read positions, backlog and lag;
this module is the consume loop (fetch, sort, dead-letter, rewind), commits and seeks.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from types import TracebackType
from typing import Any

from aiokafka import AIOKafkaConsumer, ConsumerRecord, TopicPartition
from aiokafka.errors import CommitFailedError

from fleetrl.broker import positions
from fleetrl.broker.clients import DEAD_LETTER_SLACK_BYTES, bounded, client_kwargs, connect, stop_client
from fleetrl.broker.delivery import EXPECTED_SCHEMA, Delivery, decode_batch, delivery
from fleetrl.broker.errors import KafkaError, RecordError
from fleetrl.broker.membership import RebalanceListener, assignor, leave_generation_zero
from fleetrl.broker.naming import Stream, topic_name
from fleetrl.broker.offsets import TP, OffsetTracker
from fleetrl.broker.producer import Producer
from fleetrl.broker.records import RecordLimits
from fleetrl.config import FleetConfig
from fleetrl.log import get_logger

__all__ = ["EXPECTED_SCHEMA", "MAX_REBALANCE_WAITS", "Consumer", "Delivery"]

log = get_logger(__name__)
MAX_REBALANCE_WAITS = 2
"""Polls in a row a rebalance may outlast before the member gives up (the second one raises)."""
# How many records one poll may read on while the ones it read were refused (see `Consumer.poll`).
_REFILL_RECORDS = 4096
_REFILL_BATCH = 512


class Consumer:
    """`async with Consumer(config, region, streams, group, limits, dead_letter, client_id) as c`."""

    def __init__(
        self,
        config: FleetConfig,
        region: str,
        streams: list[Stream],
        group: str,
        limits: RecordLimits,
        dead_letter: Producer,
        client_id: str,
        priority: bool = False,
        *,
        session_timeout_s: float = 6.0,
        heartbeat_interval_s: float = 1.0,
        max_poll_interval_s: float = 600.0,
        on_assigned: Callable[[set[TP]], None] | None = None,
        join_in_background: bool = False,
    ) -> None:
        if not streams or len(set(streams)) != len(streams) or "dead-letter" in streams:
            raise ValueError(f"streams must be distinct data streams, got {streams!r}")
        config.region(region)
        self.config, self.region, self.group, self.client_id = config, region, group, client_id
        self.streams, self.limits, self.priority = list(streams), limits, priority
        self._dead_letter = dead_letter
        self._topics = [topic_name(config.run, s) for s in streams]
        self._stream_of: dict[str, Stream] = dict(zip(self._topics, streams, strict=True))
        self._timeouts = (session_timeout_s, heartbeat_interval_s, max_poll_interval_s)
        self._consumer: AIOKafkaConsumer | None = None
        self._closed = False
        self._tracker = OffsetTracker()
        self._dead_count = 0
        self._pending_seeks: dict[TP, int] = {}
        self._on_assigned_hook = on_assigned
        """Told each new assignment (every partition this member now owns) after a rebalance."""
        self._join_in_background = join_in_background
        """`start()` returns once connected, the group joined in the background (polls return nothing until
        the first assignment), instead of waiting for the first assignment within the request timeout: in a
        group whose members change every few seconds a join can take longer than that."""
        self.rebalance_waits = 0
        """Polls that came back empty because a rebalance outlasted their bound (`consumer.rebalance_slow`)."""
        self._waits_in_a_row = 0

    @property
    def timeouts(self) -> tuple[float, float, float]:
        """(session timeout, heartbeat interval, max poll interval) of this member, in seconds."""
        return self._timeouts

    # -- lifecycle ------------------------------------------------------------------------------

    async def start(self) -> Consumer:
        if self._closed:
            raise KafkaError(f"consumer {self.client_id!r} was closed and cannot be reopened")
        if self._consumer is not None:
            return self
        fetch_bytes = self.config.kafka.max_message_bytes + DEAD_LETTER_SLACK_BYTES
        session, heartbeat, max_poll = self._timeouts
        self._consumer = AIOKafkaConsumer(
            **client_kwargs(self.config, self.region, self.client_id),
            group_id=self.group,
            enable_auto_commit=False,
            auto_offset_reset="earliest",
            max_partition_fetch_bytes=fetch_bytes,
            fetch_max_bytes=fetch_bytes,
            session_timeout_ms=int(session * 1000),
            heartbeat_interval_ms=int(heartbeat * 1000),
            max_poll_interval_ms=int(max_poll * 1000),
            fetch_max_wait_ms=self.config.kafka.fetch_max_wait_ms,
            partition_assignment_strategy=(assignor(self.config.kafka.partition_assignment, self.client_id),),
        )
        if not self._join_in_background:  # subscribed before start: start() waits for the first assignment
            self._consumer.subscribe(topics=self._topics, listener=self._listener())
        try:
            await connect(self._consumer.start(), self.config, self.region,
                          f"start consumer {self.client_id!r} of group {self.group!r} (region {self.region!r})")
        except BaseException:
            await self.close()
            raise
        if self._join_in_background:
            self._consumer.subscribe(topics=self._topics, listener=self._listener())
        return self

    async def close(self) -> None:
        """Leave the group within the request timeout; commits nothing. Idempotent."""
        self._closed = True
        consumer, self._consumer = self._consumer, None
        if consumer is None:
            return
        await leave_generation_zero(consumer, self.config.kafka.request_timeout_s, self.group, self.client_id)
        try:
            await stop_client(consumer.stop(), self.config.kafka.request_timeout_s, f"stop consumer {self.client_id!r}")
        except KafkaError as exc:
            log.warning("consumer.stop_failed", group=self.group, client_id=self.client_id, error=str(exc))

    async def __aenter__(self) -> Consumer:
        return await self.start()

    async def __aexit__(
        self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.close()

    @property
    def _c(self) -> AIOKafkaConsumer:
        if self._consumer is None:
            raise KafkaError(f"consumer {self.client_id!r} is not started (use `async with`)")
        return self._consumer

    def assignment(self) -> set[TP]:
        """Partitions this member holds right now."""
        return {(tp.topic, tp.partition) for tp in self._c.assignment()}

    # -- polling --------------------------------------------------------------------------------

    async def poll(self, max_records: int, timeout_s: float) -> list[Delivery]:
        """Up to `max_records` good records, waiting at most about `timeout_s` for the first.

        Refused records do not count against `max_records`: while a fetch brought some, the consumer
        reads on through what is buffered (no waiting; up to `_REFILL_RECORDS` records, in batches of
        `_REFILL_BATCH`) and produces their dead letters together, so a flood of hostile records is
        dead-lettered in large batches instead of a few per poll. A partition that holds more good
        records than there is room for is put back to the first one not taken.
        """
        return await self._read(max_records, timeout_s)

    @property
    def dead_count(self) -> int:
        """Records this consumer has dead-lettered since it started."""
        return self._dead_count

    async def skim(self) -> int:
        """Dead-letter the refused records at the head of each partition without taking a good one:
        what a member with no room for work calls, so that a flood of hostile records does not wait
        in front of the good ones until room frees up. Reads only what is buffered or comes at once;
        each partition whose head is a good record is put back to it. Returns how many records were
        dead-lettered."""
        before = self._dead_count
        await self._read(0, 0.0)
        return self._dead_count - before

    async def _read(self, max_records: int, timeout_s: float) -> list[Delivery]:
        fetched: dict[TopicPartition, list[ConsumerRecord[Any, Any]]] = {}
        good: list[Delivery] = []
        refused: list[tuple[ConsumerRecord[Any, Any], RecordError]] = []
        back: dict[TopicPartition, int] = {}
        read = 0
        try:
            while True:
                first = not fetched
                room = max_records - len(good)
                raw = await self._fetch(room if first and room > 0 else _REFILL_BATCH, timeout_s if first else 0.0)
                if not any(raw.values()):
                    break
                for tp, batch in raw.items():
                    fetched[tp] = fetched.get(tp, []) + batch
                    read += len(batch)
                await self._sort(raw, room, good, refused, back)
                if back or (max_records > 0 and len(good) >= max_records) or not refused or read >= _REFILL_RECORDS:
                    break
            if refused:
                await asyncio.gather(*(self._dead_letter_one(m, error) for m, error in refused))
        except BaseException:
            self._rewind(fetched)
            raise
        assigned = self._c.assignment()
        for tp, offset in back.items():
            if tp in assigned:
                self._c.seek(tp, offset)
        for d in good:
            self._tracker.delivered(d.tp, d.offset)
        return good

    async def _sort(self, raw: dict[TopicPartition, list[ConsumerRecord[Any, Any]]], room: int,
                    good: list[Delivery], refused: list[tuple[ConsumerRecord[Any, Any], RecordError]],
                    back: dict[TopicPartition, int]) -> None:
        """Split a fetch into the good records there is `room` for and the refused ones before them;
        a partition's first good record over the room goes into `back` (its later records are left
        for the next read)."""
        messages = [m for batch in raw.values() for m in batch]
        results = iter(await decode_batch(messages, self.limits, self._stream_of))
        for tp, batch in raw.items():
            for i, m in enumerate(batch):
                result = next(results)
                if isinstance(result, RecordError):
                    refused.append((m, result))
                elif room > 0:
                    good.append(delivery(m, result, self._stream_of[m.topic]))
                    room -= 1
                else:
                    back[tp] = m.offset
                    for _ in batch[i + 1:]:  # keep `results` in step with the next partition
                        next(results)
                    break

    async def _dead_letter_one(self, m: ConsumerRecord[Any, Any], error: RecordError) -> None:
        """Its offset is handled once the dead letter is acknowledged (the producer batches them)."""
        await self._dead_letter.dead_letter(m.key, m.value or b"", error, m.topic, m.partition, m.offset,
                                            headers=list(m.headers or ()))
        self._tracker.dead((m.topic, m.partition), m.offset)
        self._dead_count += 1

    def _rewind(self, raw: dict[TopicPartition, list[ConsumerRecord[Any, Any]]]) -> None:
        """Put the positions back to the start of a batch that is not returned (in full).

        The bookkeeping stays: offsets already dead-lettered are handled, even if read again.
        """
        for tp, batch in raw.items():
            if batch and self._consumer is not None and tp in self._consumer.assignment():
                self._consumer.seek(tp, batch[0].offset)

    async def _fetch(self, max_records: int, timeout_s: float) -> dict[TopicPartition, list[ConsumerRecord[Any, Any]]]:
        c = self._c
        if not self.priority or len(self._topics) == 1:
            return await self._getmany((), max_records, timeout_s)
        assigned = c.assignment()
        levels = [[tp for tp in assigned if tp.topic == topic] for topic in self._topics]
        for i, tps in enumerate(levels[:-1]):
            if tps and await self._has_backlog(tps):
                # A rebalance may have revoked some meanwhile (a spot region changes members every few
                # seconds): pausing or resuming a partition no longer held is an error in aiokafka.
                held = c.assignment()
                mine = [tp for tp in tps if tp in held]
                if not mine:
                    continue
                c.pause(*(tp for level in levels[i + 1 :] for tp in level if tp in held))
                c.resume(*mine)
                return await self._getmany(mine, max_records, timeout_s)
        c.resume(*c.assignment())
        raw = await self._getmany((), max_records, timeout_s)
        return self._keep_highest(raw)

    async def _getmany(
        self, tps: Any, max_records: int, timeout_s: float
    ) -> dict[TopicPartition, list[ConsumerRecord[Any, Any]]]:
        what = f"poll group {self.group!r} (region {self.region!r})"
        bound = timeout_s + self.config.kafka.request_timeout_s
        try:
            result: dict[TopicPartition, list[ConsumerRecord[Any, Any]]] = await bounded(
                self._c.getmany(*tps, timeout_ms=int(timeout_s * 1000), max_records=max_records), bound, what
            )
        except KafkaError as exc:
            # aiokafka's getmany waits, unbounded, for a rebalance in progress to assign; in a group whose
            # members change every few seconds (a spot region) one can outlast the bound. That is no
            # broker failure: nothing was read, and the next poll waits again. A member still waiting
            # after MAX_REBALANCE_WAITS bounds in a row is stuck (tansu was seen holding a churning
            # group's rebalance for minutes): the error goes up, and a new member (a restarted worker)
            # joins afresh.
            if not (isinstance(exc.__cause__, TimeoutError) and self._rebalancing()) \
                    or self._waits_in_a_row + 1 >= MAX_REBALANCE_WAITS:
                raise
            self._waits_in_a_row += 1
            self.rebalance_waits += 1
            log.warning("consumer.rebalance_slow", group=self.group, client_id=self.client_id, waited_s=bound)
            return {}
        self._waits_in_a_row = 0
        return result

    def _rebalancing(self) -> bool:
        """Whether this member is between a revocation and its next assignment (aiokafka's subscription state)."""
        subscription = getattr(self._c, "_subscription", None)
        return bool(getattr(subscription, "reassignment_in_progress", False))

    async def _has_backlog(self, tps: list[TopicPartition]) -> bool:
        """Whether any of `tps` holds records past this member's read position (`positions.has_backlog`)."""
        return await positions.has_backlog(self._c, tps, self.config.kafka.request_timeout_s)

    async def read_to_end(self) -> bool:
        """Whether this member holds partitions and has read (been handed) every record of each that
        was acknowledged before this call. False while it holds none (joining, rebalancing)."""
        tps = list(self._c.assignment())
        return bool(tps) and not await self._has_backlog(tps)

    def _keep_highest(
        self, raw: dict[TopicPartition, list[ConsumerRecord[Any, Any]]]
    ) -> dict[TopicPartition, list[ConsumerRecord[Any, Any]]]:
        """Of records fetched from several levels at once, keep the highest level's; rewind the rest."""
        present = [self._topics.index(tp.topic) for tp, batch in raw.items() if batch]
        if not present:
            return raw
        top = min(present)
        lower = {tp: batch for tp, batch in raw.items() if self._topics.index(tp.topic) != top}
        self._rewind(lower)
        return {tp: batch for tp, batch in raw.items() if self._topics.index(tp.topic) == top}

    # -- offsets --------------------------------------------------------------------------------

    async def lag(self) -> int | None:
        """Records waiting in the partitions this member holds, past its read position (`positions.lag`);
        None while no fetch has answered for any of them."""
        return await positions.lag(self._c, self.config.kafka.request_timeout_s)

    def committable_offsets(self, deliveries: list[Delivery] | None = None) -> dict[TP, int]:
        """Resume points per partition: what is committed, moved on by `deliveries` if given.

        The trainer stores this (with the deliveries its checkpoint covers) and `seek`s to it on
        start; `commit(deliveries)` would commit exactly these points.
        """
        given = [(d.tp, d.offset) for d in deliveries or []]
        return {**self._tracker.positions(), **self._tracker.targets(given)}

    async def commit(self, deliveries: list[Delivery]) -> None:
        """Commit one past the highest offset of `deliveries` per partition (and handled dead letters).

        Partitions this member no longer holds are skipped: their new owner re-reads them, and
        receivers deduplicate by group id. So is a commit the group refuses because it rebalanced
        while the commit was on its way (`CommitFailedError`: a member joined or left, as spot nodes
        do every minute): the partitions are another member's by now. A worker used to die of it.
        """
        given = [(d.tp, d.offset) for d in deliveries]
        targets = self._tracker.targets(given)
        assigned = self.assignment()
        points = {tp: off for tp, off in targets.items() if tp in assigned}
        if len(points) < len(targets):
            log.warning("commit.skipped_revoked", group=self.group,
                        partitions=sorted(f"{t}[{p}]" for t, p in set(targets) - set(points)))
        if points:
            offsets = {TopicPartition(t, p): off for (t, p), off in points.items()}
            try:
                await bounded(self._c.commit(offsets), self.config.kafka.request_timeout_s,
                              f"commit group {self.group!r} (region {self.region!r})")
            except KafkaError as exc:
                if not isinstance(exc.__cause__, CommitFailedError):
                    raise
                log.warning("commit.skipped_rebalanced", group=self.group, error=str(exc.__cause__)[:200],
                            partitions=sorted(f"{t}[{p}]" for t, p in points))
                points = {}
        self._tracker.committed(points, given)

    def seek(self, offsets: dict[TP, int]) -> None:
        """Read each partition from the given offset: now if assigned, else when it is assigned."""
        assigned = self._c.assignment() if self._consumer is not None else set()
        for (topic, partition), offset in offsets.items():
            tp = TopicPartition(topic, partition)
            if tp in assigned:
                self._c.seek(tp, offset)
                self._tracker.forget([(topic, partition)])
            else:
                self._pending_seeks[(topic, partition)] = offset

    def _listener(self) -> RebalanceListener:
        return RebalanceListener(self._on_revoked, self._on_assigned)

    def _on_assigned(self, assigned: set[TopicPartition]) -> None:
        for tp in assigned:
            offset = self._pending_seeks.pop((tp.topic, tp.partition), None)
            if offset is not None:
                self._c.seek(tp, offset)
        log.info("consumer.assigned", group=self.group, client_id=self.client_id, partitions=len(assigned))
        if self._on_assigned_hook is not None:
            self._on_assigned_hook({(tp.topic, tp.partition) for tp in assigned})

    def _on_revoked(self, revoked: set[TopicPartition]) -> None:
        self._tracker.forget((tp.topic, tp.partition) for tp in revoked)
