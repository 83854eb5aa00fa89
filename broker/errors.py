"""Errors of the broker layer.

    BrokerError                 base; `retriable` says whether the same call may succeed later
    ├── RecordError             a record that fails decoding, its schema or its bounds
    │   └── RecordTooLarge      a record over the topic's max.message.bytes, refused before sending
    ├── KafkaError              a Kafka client failure, translated at the boundary (aiokafka's flag kept)
    ├── TopicError              topic tooling: a topic missing, or configured unlike the spec
    └── ControlPlaneError       the MQTT control plane

Record errors name the field at fault and, once a consumer attaches it, the topic, partition and
offset the bytes came from; `reason` is the short code written into the dead-letter headers.
"""

from __future__ import annotations


class BrokerError(Exception):
    """Base of every broker-layer error."""

    retriable: bool = False


class RecordError(BrokerError):
    """A record that cannot be accepted: malformed bytes, wrong schema, or outside its bounds."""

    def __init__(
        self,
        reason: str,
        message: str,
        *,
        field: str | None = None,
        topic: str | None = None,
        partition: int | None = None,
        offset: int | None = None,
        group_id: str | None = None,
    ) -> None:
        self.reason, self.message, self.field = reason, message, field
        self.topic, self.partition, self.offset, self.group_id = topic, partition, offset, group_id
        super().__init__(self._render())

    def at(self, topic: str, partition: int, offset: int) -> RecordError:
        """Attach where the record was read; returns self for `raise err.at(...)`."""
        self.topic, self.partition, self.offset = topic, partition, offset
        self.args = (self._render(),)
        return self

    def _render(self) -> str:
        where = f"{self.topic}[{self.partition}]@{self.offset}: " if self.topic is not None else ""
        field = f"field {self.field!r}: " if self.field else ""
        group = f" (group {self.group_id})" if self.group_id else ""
        return f"{where}{field}{self.message}{group}"

    def __str__(self) -> str:
        return self._render()


class RecordTooLarge(RecordError):
    """An encoded record larger than the topic accepts; never sent, never truncated."""

    def __init__(self, group_id: str, size: int, limit: int, topic: str | None = None) -> None:
        super().__init__(
            "too_large",
            f"record of {size} bytes exceeds max.message.bytes {limit}",
            group_id=group_id,
            topic=topic,
        )
        self.size, self.limit = size, limit


class KafkaError(BrokerError):
    """A Kafka client error; `retriable` comes from the underlying client where it says."""

    def __init__(self, message: str, *, retriable: bool = False) -> None:
        super().__init__(message)
        self.retriable = retriable


class TopicError(BrokerError):
    """A topic that is missing or configured unlike its spec."""


class ControlPlaneError(BrokerError):
    """The MQTT control plane could not be reached or answered badly."""

    retriable = True
