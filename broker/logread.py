"""Read a topic of one region from its log start to its current end, without a consumer group.

Operator tools (`fleetrl topics dlq show`, `fleetrl audit`) need every record that exists now and
nothing more: the end offsets are taken when the read begins (confirmed by a fetch, see
`log_ends`), so a read never waits for records that do not exist yet. Uses the region's full
client settings (TLS, SASL) like every other client of the package.

A read is bounded by progress, not by a total: it fails (naming the topic, the region and how much
was left) when `kafka.request_timeout_s` passes without a record, however long the log. A durable
broker serving a long run's log from object storage may take minutes, and that is not a fault.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from aiokafka import TopicPartition

from fleetrl.broker.clients import bounded
from fleetrl.broker.errors import KafkaError, TopicError
from fleetrl.broker.lag import log_ends, reader
from fleetrl.broker.topics import describe_topics
from fleetrl.config import FleetConfig


@dataclass(frozen=True, slots=True)
class RawRecord:
    """One record as it sits in the log: undecoded bytes and headers."""

    partition: int
    offset: int
    key: bytes | None
    value: bytes
    headers: list[tuple[str, bytes]]


async def read_log(
    config: FleetConfig, region: str, topic: str, limit: int | None = None, client_id: str = "fleetrl-read"
) -> list[RawRecord]:
    """Every record of `topic` in `region` (at most `limit`), oldest first per partition."""
    records, _ = await read_log_from(config, region, topic, None, limit, client_id)
    return records


async def read_log_from(
    config: FleetConfig, region: str, topic: str, from_offsets: dict[int, int] | None,
    limit: int | None = None, client_id: str = "fleetrl-read", stall_timeout_s: float | None = None,
) -> tuple[list[RawRecord], dict[int, int]]:
    """The records of `topic` in `region` from `from_offsets[partition]` (or the log start, where
    that is later or no offset is given) to the current end, and each partition's log start (where
    retention has cut the log). Fails when no record arrives for `stall_timeout_s` (default
    `kafka.request_timeout_s`)."""
    states = await describe_topics(config, region, [topic])
    if topic not in states:
        raise TopicError(f"region {region!r} has no topic {topic}; run `fleetrl topics create` first")
    tps = [TopicPartition(topic, p) for p in sorted(states[topic].leaders)]
    cap = limit if limit is not None else float("inf")
    timeout = config.kafka.request_timeout_s
    stall_s = stall_timeout_s if stall_timeout_s is not None else timeout
    out: list[RawRecord] = []
    async with reader(config, region, client_id) as consumer:
        consumer.assign(tps)
        ends = await log_ends(consumer, tps, timeout)
        starts = await bounded(consumer.beginning_offsets(tps), timeout, f"start offsets of {topic} ({region!r})")
        begin = {tp: max(starts[tp], (from_offsets or {}).get(tp.partition, 0)) for tp in tps}
        read_to: dict[TopicPartition, int] = {}
        for tp in tps:
            consumer.seek(tp, begin[tp])
        remaining = {tp for tp in tps if ends[tp] > begin[tp]}
        loop = asyncio.get_running_loop()
        last_progress = loop.time()
        while remaining and len(out) < cap:
            if loop.time() - last_progress > stall_s:
                left = sum(ends[tp] - read_to.get(tp, begin[tp]) for tp in remaining)
                raise KafkaError(f"region {region!r}: {topic} could not be read to its end: no record for "
                                 f"{stall_s:.0f} s with about {left} left (read {len(out)})", retriable=True)
            want = 1000 if limit is None else max(1, min(1000, limit - len(out)))
            batch = await bounded(consumer.getmany(*remaining, timeout_ms=500, max_records=want), timeout,
                                  f"fetch {topic} ({region!r})")
            for tp, messages in batch.items():
                if messages:
                    last_progress = loop.time()
                    read_to[tp] = messages[-1].offset + 1
                out += [RawRecord(m.partition, m.offset, m.key, m.value or b"", list(m.headers or ()))
                        for m in messages if m.offset < ends[tp]]
                if messages and messages[-1].offset + 1 >= ends[tp]:
                    remaining.discard(tp)
    return (out if limit is None else out[:limit]), {tp.partition: starts[tp] for tp in tps}
