"""Per-partition lag of the run's consumer groups on a region cluster (`fleetrl topics lag`).

Lag is `end offset - committed offset` per partition: the rollout group (`fleetrl.<run>.rollout`)
reads `prompts` and `partials`, the trainer group (`fleetrl.<run>.trainer`) reads `trajectories`.
A partition the group never committed counts from the log start, since a new member would read it
from there (`auto_offset_reset=earliest`).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass

from aiokafka import AIOKafkaConsumer, TopicPartition

from fleetrl.broker.clients import DEAD_LETTER_SLACK_BYTES, bounded, client_kwargs, connect, stop_client
from fleetrl.broker.errors import KafkaError
from fleetrl.broker.naming import Stream, rollout_group, topic_name, trainer_group
from fleetrl.broker.topics import admin_client, describe_topics
from fleetrl.config import FleetConfig

GROUP_STREAMS: dict[str, tuple[Stream, ...]] = {"rollout": ("prompts", "partials"), "trainer": ("trajectories",)}


@dataclass(frozen=True, slots=True)
class PartitionLag:
    region: str
    group: str
    topic: str
    partition: int
    start: int
    end: int
    committed: int | None
    """None when the group never committed this partition."""

    @property
    def lag(self) -> int:
        return self.end - (self.committed if self.committed is not None else self.start)


@asynccontextmanager
async def reader(
    config: FleetConfig, region: str, client_id: str = "fleetrl-reader"
) -> AsyncIterator[AIOKafkaConsumer]:
    """A group-less consumer (assign + seek only; it never joins or commits for any group)."""
    fetch = config.kafka.max_message_bytes + DEAD_LETTER_SLACK_BYTES
    consumer = AIOKafkaConsumer(**client_kwargs(config, region, client_id), group_id=None, enable_auto_commit=False,
                                fetch_max_wait_ms=100,
                                max_partition_fetch_bytes=fetch, fetch_max_bytes=fetch)
    timeout = config.kafka.request_timeout_s
    try:
        await connect(consumer.start(), config, region, f"connect reader to region {region!r}")
        yield consumer
    finally:
        await stop_client(consumer.stop(), timeout, f"stop reader of region {region!r}")


async def end_offsets(config: FleetConfig, region: str, topic: str) -> dict[int, int]:
    """Next offset to be written, per partition of `topic`."""
    _, ends = await _offsets(config, region, [topic])
    return {tp.partition: offset for tp, offset in ends.items()}


async def _offsets(
    config: FleetConfig, region: str, topics: list[str]
) -> tuple[dict[TopicPartition, int], dict[TopicPartition, int]]:
    states = await describe_topics(config, region, topics)
    tps = [TopicPartition(name, p) for name, state in states.items() for p in sorted(state.leaders)]
    if not tps:
        return {}, {}
    timeout = config.kafka.request_timeout_s
    async with reader(config, region) as consumer:
        consumer.assign(tps)
        starts = await bounded(consumer.beginning_offsets(tps), timeout, f"log start offsets ({region!r})")
        ends = await log_ends(consumer, tps, timeout)
    return starts, ends


async def log_ends(
    consumer: AIOKafkaConsumer, tps: list[TopicPartition], timeout_s: float
) -> dict[TopicPartition, int]:
    """End offsets of assigned partitions, confirmed by a fetch.

    tansu with S3 storage answers ListOffsets(latest) wrongly (1 where the log holds 6), while its
    fetch responses carry the right high watermark: so fetch once from the reported end and keep
    the larger of the two. Moves the partitions' positions.
    """
    ends = await bounded(consumer.end_offsets(tps), timeout_s, f"end offsets of {tps[0].topic}")
    for tp in tps:
        consumer.seek(tp, ends[tp])
    try:
        async with asyncio.timeout(timeout_s):
            while any(consumer.highwater(tp) is None for tp in tps):
                await consumer.getmany(*tps, timeout_ms=200, max_records=1)
    except TimeoutError as exc:
        raise KafkaError(f"no fetch answer for {tps[0].topic} within {timeout_s:.1f} s", retriable=True) from exc
    return {tp: max(ends[tp], consumer.highwater(tp)) for tp in tps}


async def end_offsets_by_tp(config: FleetConfig, region: str, topics: list[str]) -> dict[tuple[str, int], int]:
    """End offsets of several topics, keyed by (topic, partition)."""
    _, ends = await _offsets(config, region, topics)
    return {(tp.topic, tp.partition): off for tp, off in ends.items()}


async def group_lag(config: FleetConfig, region: str) -> list[PartitionLag]:
    """Lag of the rollout and trainer groups on every partition of the topics they read."""
    rows: list[PartitionLag] = []
    for role, streams in GROUP_STREAMS.items():
        group = rollout_group(config.run) if role == "rollout" else trainer_group(config.run)
        starts, ends = await _offsets(config, region, [topic_name(config.run, s) for s in streams])
        if not ends:
            continue
        async with admin_client(config, region) as admin:
            committed = await bounded(admin.list_consumer_group_offsets(group, partitions=list(ends)),
                                      config.kafka.request_timeout_s, f"committed offsets of {group!r} ({region!r})")
        for tp in sorted(ends):
            meta = committed.get(tp)
            point = meta.offset if meta is not None and meta.offset >= 0 else None
            rows.append(PartitionLag(region, group, tp.topic, tp.partition, starts[tp], ends[tp], point))
    return rows
