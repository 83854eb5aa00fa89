"""The data-plane producer: one per (process, region cluster), wrapping aiokafka.

`send` encodes a record (msgpack, DESIGN.md §3), refuses it before sending when it is larger than
the topic's `max.message.bytes` (`RecordTooLarge` names the group id and size), adds the
`fleetrl-schema` header and waits for the broker's acknowledgement, so that a caller may commit
what it consumed only after `send` returned (commit-after-effect). Retriable failures are retried a
bounded number of times with exponential backoff; everything else surfaces as `KafkaError`.
Compression is Kafka-level zstd (aiokafka uses cramjam for it) unless the config says otherwise.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from types import TracebackType

from aiokafka import AIOKafkaProducer
from aiokafka.record.default_records import DefaultRecordBatchBuilder

from fleetrl.broker.clients import (
    DEAD_LETTER_SLACK_BYTES,
    bounded,
    client_kwargs,
    connect,
    stop_client,
    translated,
    with_retries,
)
from fleetrl.broker.codec import encode_record
from fleetrl.broker.deadletter import dead_letter_headers
from fleetrl.broker.errors import KafkaError, RecordError, RecordTooLarge
from fleetrl.broker.naming import SCHEMA_HEADER, Stream, topic_name
from fleetrl.broker.records import Record
from fleetrl.config import FleetConfig
from fleetrl.log import LogBudget, get_logger

log = get_logger(__name__)
# Records per partition sent in one request, up to this many bytes (aiokafka's default is 16 KiB, which
# a burst of small records, e.g. a flood of dead letters, turns into hundreds of requests).
_BATCH_BYTES = 256 * 1024


class Producer:
    """`async with Producer(config, region, client_id) as p: await p.send(stream, key, record)`.

    `dead_lettered` counts the records this producer dead-lettered, by reason; `on_dead_letter`, if
    given, is called with the reason of each once the broker acknowledged it (daemons count it in
    their metrics: the broker package itself exposes none). Each is logged as `record.dead_lettered`,
    at most 20 lines in 10 s; the rest are summed in one `record.dead_lettered.suppressed` line.
    """

    def __init__(self, config: FleetConfig, region: str, client_id: str,
                 *, on_dead_letter: Callable[[str], None] | None = None) -> None:
        config.region(region)  # fail now, naming the regions, rather than at start
        self.config, self.region, self.client_id = config, region, client_id
        self.dead_lettered: Counter[str] = Counter()
        self._on_dead_letter = on_dead_letter
        self._dead_letter_log = LogBudget("record.dead_lettered")  # a flood is not 100,000 log lines
        self._producer: AIOKafkaProducer | None = None
        self._closed = False

    @property
    def max_message_bytes(self) -> int:
        """Largest record (value, key and headers) the data topics accept."""
        return self.config.kafka.max_message_bytes

    @property
    def dead_letter_topic(self) -> str:
        return topic_name(self.config.run, "dead-letter")

    async def start(self) -> Producer:
        if self._closed:
            raise KafkaError(f"producer {self.client_id!r} was closed and cannot be reopened")
        if self._producer is not None:
            return self
        k = self.config.kafka
        self._producer = AIOKafkaProducer(
            **client_kwargs(self.config, self.region, self.client_id),
            acks="all",
            compression_type=None if k.compression == "none" else k.compression,
            max_request_size=k.max_message_bytes + DEAD_LETTER_SLACK_BYTES,
            enable_idempotence=k.idempotent_producer,
            retry_backoff_ms=int(k.retry_backoff_s * 1000),
            max_batch_size=_BATCH_BYTES,
        )
        try:
            await connect(self._producer.start(), self.config, self.region,
                          f"start producer for region {self.region!r}")
        except BaseException:
            await self.close()
            raise
        log.debug("producer.started", region=self.region, client_id=self.client_id)
        return self

    async def close(self) -> None:
        """Flush and stop, within the request timeout; idempotent."""
        self._closed = True
        self._dead_letter_log.flush(log)
        producer, self._producer = self._producer, None
        if producer is None:
            return
        try:
            await stop_client(producer.stop(), self.config.kafka.request_timeout_s, f"stop producer {self.client_id!r}")
        except KafkaError as exc:
            log.warning("producer.stop_failed", region=self.region, client_id=self.client_id, error=str(exc))

    async def __aenter__(self) -> Producer:
        return await self.start()

    async def __aexit__(
        self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.close()

    async def send(self, stream: Stream, key: str, record: Record) -> tuple[int, int]:
        """Encode `record`, refuse it if too large, produce it and wait for the broker's ack; returns
        the (partition, offset) the broker gave it (the trainer's ledger keeps them: see its audit
        watermark)."""
        if stream == "dead-letter":
            raise ValueError("dead letters are produced with dead_letter(), which adds the error headers")
        topic = topic_name(self.config.run, stream)
        value = encode_record(record)
        headers = [(SCHEMA_HEADER, record.schema.encode())]
        key_bytes = key.encode()
        self._check_size(topic, key_bytes, value, headers, self.max_message_bytes, record.group_id)
        return await self._produce(topic, key_bytes, value, headers)

    async def send_raw(
        self, topic: str, key: bytes | None, value: bytes, headers: list[tuple[str, bytes]]
    ) -> None:
        """Produce bytes as they are (replays, tooling); refused if over the topic's limit."""
        limit = self.max_message_bytes + (DEAD_LETTER_SLACK_BYTES if topic == self.dead_letter_topic else 0)
        group = key.decode(errors="replace") if key else "<no key>"
        self._check_size(topic, key, value, headers, limit, group)
        await self._produce(topic, key, value, headers)

    async def dead_letter(
        self,
        key: bytes | None,
        value: bytes,
        error: RecordError,
        topic: str,
        partition: int,
        offset: int,
        headers: list[tuple[str, bytes]] | None = None,
    ) -> None:
        """Re-produce a refused record to the dead-letter topic with the reason and where it came from."""
        dl_headers = dead_letter_headers(error, topic, partition, offset, headers)
        await self.send_raw(self.dead_letter_topic, key, value, dl_headers)
        self.dead_lettered[error.reason] += 1
        if self._on_dead_letter is not None:
            self._on_dead_letter(error.reason)
        self._dead_letter_log.warning(log, error.reason, topic=topic, partition=partition, offset=offset,
                                      reason=error.reason, field=error.field, group_id=error.group_id)

    def _check_size(
        self, topic: str, key: bytes | None, value: bytes, headers: list[tuple[str, bytes]], limit: int, group: str
    ) -> None:
        # aiokafka's own upper bound of the record in a batch: the broker checks the (compressed)
        # batch against max.message.bytes, so this never lets through what the broker would refuse.
        size = DefaultRecordBatchBuilder.estimate_size_in_bytes(key, value, list(headers))
        if size > limit:
            raise RecordTooLarge(group, size, limit, topic=topic)

    async def _produce(
        self, topic: str, key: bytes | None, value: bytes, headers: list[tuple[str, bytes]]
    ) -> tuple[int, int]:
        producer = self._producer
        if producer is None:
            raise KafkaError(f"producer {self.client_id!r} is not started (use `async with`)")
        k = self.config.kafka
        what = f"produce to {topic} (region {self.region!r})"

        async def once() -> tuple[int, int]:
            with translated(what):
                meta = await producer.send_and_wait(topic, value, key=key, headers=headers)
            return int(meta.partition), int(meta.offset)

        # aiokafka retries inside request_timeout; the outer bound only guards against a hang.
        return await with_retries(
            lambda: bounded(once(), k.request_timeout_s + 5.0, what),
            what=what, retries=k.retries, backoff_s=k.retry_backoff_s,
        )
