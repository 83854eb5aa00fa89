"""Follow a topic of one region from near its end, without a consumer group.

A reader that must take nothing from anyone (each rollout worker reads its region's `trajectories`,
which the trainer's group `fleetrl.<run>.trainer` consumes, for its response history) assigns the
partitions itself and never joins, commits for or leaves a group: no group's membership or offsets
change, whatever it reads (tansu serves such fetches like any Kafka). It starts `window` records
before each partition's end as the read begins (the newest records that exist; all of a shorter log)
and returns what follows, as the log holds it (`RawRecord`): what a bad record means is the
caller's business, nothing is dead-lettered here. A reader that reopens after a failure passes the
offsets it had reached (`from_offsets`) and goes on from there, but never from further back than the
window.

Partitions added to the topic after `start` are not read.
"""

from __future__ import annotations

from contextlib import AsyncExitStack
from types import TracebackType

from aiokafka import AIOKafkaConsumer, TopicPartition

from fleetrl.broker.clients import bounded
from fleetrl.broker.errors import KafkaError, TopicError
from fleetrl.broker.lag import log_ends, reader
from fleetrl.broker.logread import RawRecord
from fleetrl.broker.naming import Stream, topic_name
from fleetrl.broker.topics import describe_topics
from fleetrl.config import FleetConfig


class LogTail:
    """`async with LogTail(config, region, stream, client_id, window=n) as tail: await tail.read(...)`."""

    def __init__(self, config: FleetConfig, region: str, stream: Stream, client_id: str, *, window: int,
                 from_offsets: dict[int, int] | None = None) -> None:
        if window < 0:
            raise ValueError(f"window must be >= 0, got {window}")
        config.region(region)
        self.config, self.region, self.client_id, self.window = config, region, client_id, window
        self.from_offsets = dict(from_offsets or {})
        """Partition -> the offset to go on from (where an earlier tail stopped), if later than the window."""
        self.topic = topic_name(config.run, stream)
        self._stack: AsyncExitStack | None = None
        self._consumer: AIOKafkaConsumer | None = None
        self._closed = False

    async def start(self) -> LogTail:
        """Assign every partition of the topic and place each `window` records before its end (or at
        its `from_offsets` entry, where that is later)."""
        if self._closed:
            raise KafkaError(f"log tail {self.client_id!r} of {self.topic} was closed and cannot be reopened")
        if self._consumer is not None:
            return self
        states = await describe_topics(self.config, self.region, [self.topic])
        if self.topic not in states:
            raise TopicError(f"region {self.region!r} has no topic {self.topic}; run `fleetrl topics create` first")
        tps = [TopicPartition(self.topic, p) for p in sorted(states[self.topic].leaders)]
        timeout = self.config.kafka.request_timeout_s
        self._stack = AsyncExitStack()
        try:
            consumer = await self._stack.enter_async_context(reader(self.config, self.region, self.client_id))
            consumer.assign(tps)
            ends = await log_ends(consumer, tps, timeout)
            starts = await bounded(consumer.beginning_offsets(tps), timeout,
                                   f"start offsets of {self.topic} ({self.region!r})")
            for tp in tps:  # (an offset past the end: a log that restarted empty)
                resume = min(self.from_offsets.get(tp.partition, 0), ends[tp])
                consumer.seek(tp, max(starts[tp], ends[tp] - self.window, resume))
        except BaseException:
            await self.close()
            raise
        self._consumer = consumer
        return self

    async def read(self, max_records: int, timeout_s: float) -> list[RawRecord]:
        """Up to `max_records` records that follow the last read (any partitions), waiting at most
        about `timeout_s` for the first."""
        if self._consumer is None:
            raise KafkaError(f"log tail {self.client_id!r} is not started (use `async with`)")
        batch = await bounded(self._consumer.getmany(timeout_ms=int(timeout_s * 1000), max_records=max_records),
                              timeout_s + self.config.kafka.request_timeout_s, f"fetch {self.topic} ({self.region!r})")
        return [RawRecord(m.partition, m.offset, m.key, m.value or b"", list(m.headers or ()))
                for messages in batch.values() for m in messages]

    async def close(self) -> None:
        """Stop the client within the request timeout. Idempotent."""
        self._closed = True
        stack, self._stack, self._consumer = self._stack, None, None
        if stack is not None:
            await stack.aclose()

    async def __aenter__(self) -> LogTail:
        return await self.start()

    async def __aexit__(
        self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.close()
