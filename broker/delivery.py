"""What a consumed record becomes: a checked `Delivery`, or the `RecordError` that dead-letters it.

The consumer (`consumer.py`) fetches raw records and hands each batch to `decode_batch`: every value
is decoded against its stream's schema and bounds (`fleetrl.broker.codec`) and its `fleetrl-schema`
header checked; a record that passes becomes a `Delivery`, one that fails its `RecordError` (with
topic, partition and offset), which the consumer dead-letters. Large batches decode in a thread.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

from aiokafka import ConsumerRecord

from fleetrl.broker.codec import decode_record
from fleetrl.broker.errors import RecordError
from fleetrl.broker.naming import SCHEMA_HEADER, Stream
from fleetrl.broker.offsets import TP
from fleetrl.broker.records import SCHEMA_GROUP, SCHEMA_PARTIAL, SCHEMA_PROMPT, Record, RecordLimits

EXPECTED_SCHEMA: dict[str, str] = {"prompts": SCHEMA_PROMPT, "partials": SCHEMA_PARTIAL, "trajectories": SCHEMA_GROUP}
# Decoding is cheap (numpy views over the bytes, a few reductions a group: 0.24 ms for a group of 16 x
# 1,024 tokens, 0.13 MB), but a batch of many MB still blocks the loop for a while: above this many
# bytes (about 60 ms of decoding) it runs in a thread. Not lower: a thread holds the GIL against the
# loop and every other region's decode, and `bench/ingest.py` took in 373-417 groups/s with 1 MB here
# against 483-543 with every batch decoded on the loop.
_DECODE_IN_THREAD_BYTES = 32 << 20


@dataclass(slots=True)
class Delivery:
    """One decoded, bounds-checked record and where it came from."""

    topic: str
    partition: int
    offset: int
    key: str | None
    record: Record
    headers: dict[str, bytes]
    stream: Stream
    size: int = 0
    """Bytes of the record's value as it crossed the wire (uncompressed): what its link carried."""

    @property
    def tp(self) -> TP:
        return (self.topic, self.partition)


async def decode_batch(messages: list[ConsumerRecord[Any, Any]], limits: RecordLimits,
                       stream_of: dict[str, Stream]) -> list[Record | RecordError]:
    """Each message decoded and checked (in order): its record, or why it is refused."""
    if sum(len(m.value or b"") for m in messages) > _DECODE_IN_THREAD_BYTES:
        return await asyncio.to_thread(_decode_all, messages, limits, stream_of)
    return _decode_all(messages, limits, stream_of)


def _decode_all(messages: list[ConsumerRecord[Any, Any]], limits: RecordLimits,
                stream_of: dict[str, Stream]) -> list[Record | RecordError]:
    out: list[Record | RecordError] = []
    for m in messages:
        expect = EXPECTED_SCHEMA[stream_of[m.topic]]
        try:
            record = decode_record(m.value or b"", limits, expect=expect)
            _check_schema_header(m.headers, getattr(record, "schema", expect))
            out.append(record)
        except RecordError as err:
            out.append(err.at(m.topic, m.partition, m.offset))
    return out


def _check_schema_header(headers: Any, expect: str) -> None:
    """Every record carries its schema in the `fleetrl-schema` header too (DESIGN.md §3): one without
    it did not come from a FleetRL producer."""
    found = [v for k, v in (headers or ()) if k == SCHEMA_HEADER]
    if not found:
        raise RecordError("missing_header", f"no {SCHEMA_HEADER} header", field=SCHEMA_HEADER)
    if found[0] != expect.encode():
        raise RecordError("wrong_schema", f"header {SCHEMA_HEADER} is {found[0]!r}, expected {expect!r}",
                          field=SCHEMA_HEADER)


def delivery(m: ConsumerRecord[Any, Any], record: Record, stream: Stream) -> Delivery:
    """The delivery of message `m`, decoded as `record`."""
    return Delivery(topic=m.topic, partition=m.partition, offset=m.offset,
                    key=m.key.decode(errors="replace") if m.key is not None else None,
                    record=record, headers=dict(m.headers or ()), stream=stream,
                    size=len(m.value) if m.value is not None else 0)
