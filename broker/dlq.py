"""Reading and replaying the dead-letter topic (`fleetrl topics dlq show|replay`).

Dead letters are read with a group-less reader from the log start to the end offsets taken when
the read began, so a `show` never waits for records that do not exist. `replay` re-produces the
original key, bytes and headers (the error headers removed) to the original topic, after an operator
fixed whatever refused them (a task registered, a bound raised). Kafka cannot delete single records:
a replayed dead letter stays in the topic; the replayed record, if still bad, is dead-lettered again.
"""

from __future__ import annotations

from fleetrl.broker.deadletter import DeadLetter
from fleetrl.broker.errors import TopicError
from fleetrl.broker.logread import read_log
from fleetrl.broker.naming import STREAMS, topic_name
from fleetrl.broker.producer import Producer
from fleetrl.config import FleetConfig
from fleetrl.log import get_logger

log = get_logger(__name__)


async def read_dead_letters(config: FleetConfig, region: str, limit: int = 50) -> list[DeadLetter]:
    """Up to `limit` dead letters of `region`, oldest first per partition."""
    records = await read_log(config, region, topic_name(config.run, "dead-letter"), limit, "fleetrl-dlq")
    return [DeadLetter.from_record(r.partition, r.offset, r.key, r.value, r.headers) for r in records]


async def replay_dead_letters(
    config: FleetConfig, region: str, letters: list[DeadLetter], client_id: str = "fleetrl-dlq-replay"
) -> list[DeadLetter]:
    """Re-produce each dead letter to its original topic; returns those replayed, in order."""
    allowed = {topic_name(config.run, s) for s in STREAMS if s != "dead-letter"}
    for letter in letters:
        if letter.original_topic not in allowed:
            raise TopicError(f"dead letter {letter.partition}:{letter.offset} names topic "
                             f"{letter.original_topic!r}, not one of this run's data topics")
    async with Producer(config, region, client_id) as producer:
        for letter in letters:
            await producer.send_raw(letter.original_topic, letter.key, letter.value, letter.replay_headers())
            log.info("dead_letter.replayed", region=region, partition=letter.partition, offset=letter.offset,
                     topic=letter.original_topic, reason=letter.reason)
    return letters


def select(letters: list[DeadLetter], positions: list[tuple[int, int]]) -> list[DeadLetter]:
    """The dead letters at `positions` (partition, offset); a missing one is an error naming it."""
    by_pos = {(d.partition, d.offset): d for d in letters}
    missing = [f"{p}:{o}" for p, o in positions if (p, o) not in by_pos]
    if missing:
        raise TopicError(f"no dead letter at {', '.join(missing)} (see `fleetrl topics dlq show`)")
    return [by_pos[p] for p in positions]
