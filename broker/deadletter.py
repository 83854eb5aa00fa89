"""The dead-letter format: original key and bytes, plus headers that say what was wrong and where.

A record that fails decoding or its bounds is never dropped: the consumer re-produces it to
`fleetrl.<run>.dead-letter` with these headers, then counts its offset as handled. `fleetrl topics
dlq show` reads them back (`DeadLetter.from_headers`) and `dlq replay` re-produces the original bytes
to the original topic after a fix.
"""

from __future__ import annotations

from dataclasses import dataclass

from fleetrl.broker.errors import RecordError
from fleetrl.broker.naming import SCHEMA_HEADER

REASON_HEADER = "fleetrl-error-reason"
MESSAGE_HEADER = "fleetrl-error-message"
FIELD_HEADER = "fleetrl-error-field"
TOPIC_HEADER = "fleetrl-original-topic"
PARTITION_HEADER = "fleetrl-original-partition"
OFFSET_HEADER = "fleetrl-original-offset"
DEAD_LETTER_HEADERS = frozenset(
    {REASON_HEADER, MESSAGE_HEADER, FIELD_HEADER, TOPIC_HEADER, PARTITION_HEADER, OFFSET_HEADER}
)
# The message names the field and group; a megabyte of repr would only make the dead letter larger.
_MAX_MESSAGE_CHARS = 2000


def dead_letter_headers(
    error: RecordError,
    topic: str,
    partition: int,
    offset: int,
    original: list[tuple[str, bytes]] | None = None,
) -> list[tuple[str, bytes]]:
    """Error headers for a dead letter; original headers (the schema among them) are kept."""
    kept = [(k, v) for k, v in (original or []) if k not in DEAD_LETTER_HEADERS]
    headers = [
        (REASON_HEADER, error.reason.encode()),
        (MESSAGE_HEADER, str(error)[:_MAX_MESSAGE_CHARS].encode(errors="replace")),
        (TOPIC_HEADER, topic.encode()),
        (PARTITION_HEADER, str(partition).encode()),
        (OFFSET_HEADER, str(offset).encode()),
    ]
    if error.field:
        headers.append((FIELD_HEADER, error.field.encode()))
    return kept + headers


@dataclass(frozen=True, slots=True)
class DeadLetter:
    """One record of the dead-letter topic, as `dlq show` prints it and `dlq replay` re-sends it."""

    partition: int
    """Partition and offset in the dead-letter topic: what `dlq replay --offset P:O` names."""
    offset: int
    key: bytes | None
    value: bytes
    reason: str
    message: str
    field: str | None
    original_topic: str
    original_partition: int | None
    original_offset: int | None
    schema: str | None
    headers: tuple[tuple[str, bytes], ...]

    @classmethod
    def from_record(
        cls, partition: int, offset: int, key: bytes | None, value: bytes, headers: list[tuple[str, bytes]]
    ) -> DeadLetter:
        h = {k: v.decode(errors="replace") for k, v in headers}
        return cls(
            partition=partition, offset=offset, key=key, value=value,
            reason=h.get(REASON_HEADER, "unknown"), message=h.get(MESSAGE_HEADER, ""),
            field=h.get(FIELD_HEADER), original_topic=h.get(TOPIC_HEADER, ""),
            original_partition=_int_or_none(h.get(PARTITION_HEADER)),
            original_offset=_int_or_none(h.get(OFFSET_HEADER)),
            schema=h.get(SCHEMA_HEADER), headers=tuple(headers),
        )

    def replay_headers(self) -> list[tuple[str, bytes]]:
        """Headers for re-producing the original record: the error headers are removed."""
        return [(k, v) for k, v in self.headers if k not in DEAD_LETTER_HEADERS]


def _int_or_none(text: str | None) -> int | None:
    try:
        return int(text) if text is not None else None
    except ValueError:
        return None
