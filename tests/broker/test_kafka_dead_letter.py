"""Every bound of the schema, checked by the real Consumer: the record goes to dead-letter with its reason.

One scenario runs for the module (a consumer group join costs seconds on tansu): good and bad groups
are produced to `trajectories`, one Consumer polls and commits, and a group-less reader collects
the dead-letter topic. Each test then checks one bound.
"""

from __future__ import annotations

import asyncio
import math
import uuid
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest
from broker_testkit import VOCAB, fleet_yaml, make_config, make_group, poll_until
from slowdown import scaled
from structlog.testing import capture_logs

from fleetrl import devstack
from fleetrl.broker import (
    SCHEMA_HEADER,
    Consumer,
    DeadLetter,
    Delivery,
    Producer,
    RecordLimits,
    decode_record,
    ensure_topics,
    topic_name,
    trainer_group,
)
from fleetrl.broker.dlq import read_dead_letters
from fleetrl.broker.lag import group_lag

pytestmark = pytest.mark.integration

# key -> what is wrong with the group produced under that key
BAD: dict[str, dict[str, Any]] = {
    "bad-token-range": {"tokens": [1, 2, VOCAB + 5]},
    "bad-negative-token": {"tokens": [1, -3, 2]},
    "bad-samples": {"n_samples": 5},  # the config allows 4 samples per group
    "bad-nan-logprob": {"logprobs": [-0.1, math.nan, -0.2]},
    "bad-positive-logprob": {"logprobs": [-0.1, 0.5, -0.2]},
    "bad-task": {"task": "no-such-task"},
}
GOOD = [f"good-{i}" for i in range(4)]


@dataclass
class Outcome:
    run: str
    delivered: list[Delivery]
    dead: dict[str, DeadLetter]
    lag_after_commit: int
    limits: RecordLimits
    reasons_counted: list[str]
    """What the producer's `on_dead_letter` hook was called with, in order."""
    producer_counts: dict[str, int]
    member_lag: list[int | None]
    """`Consumer.lag()`: after reading all, with 3 unread records, after reading them too."""


@pytest.fixture(scope="module")
def outcome(tansu: devstack.ServerProcess) -> Outcome:
    return asyncio.run(_scenario(f"127.0.0.1:{tansu.port}"))


async def _scenario(bootstrap: str) -> Outcome:
    config = make_config(fleet_yaml(f"t{uuid.uuid4().hex[:10]}", bootstrap))
    limits = RecordLimits.from_config(config)
    await ensure_topics(config, "r1")
    reasons: list[str] = []
    member_lag: list[int | None] = []
    async with Producer(config, "r1", "dl-producer", on_dead_letter=reasons.append) as producer:
        for key in [*GOOD[:2], *BAD, *GOOD[2:]]:
            spec = dict(BAD.get(key, {}))
            n_samples = spec.pop("n_samples", 2)
            group = make_group(key, run=config.run, n_samples=n_samples, n_tokens=3, **spec)
            await producer.send("trajectories", key, group)
        await producer.send_raw(topic_name(config.run, "trajectories"), b"bad-bytes", b"\xc1 not msgpack",
                                [(SCHEMA_HEADER, b"fleetrl.group/1")])
        async with Consumer(config, "r1", ["trajectories"], trainer_group(config.run), limits, producer,
                            "dl-consumer") as consumer:
            delivered = await poll_until(consumer, len(GOOD))
            delivered += await consumer.poll(max_records=100, timeout_s=1.0)  # anything fetched late
            await consumer.commit(delivered)
            member_lag.append(await consumer.lag())
            await _unread_lag(config.run, producer, consumer, member_lag)
    dead = {(d.key or b"").decode(): d for d in await read_dead_letters(config, "r1", limit=100)}
    lag = sum(row.lag for row in await group_lag(config, "r1") if row.topic.endswith("trajectories"))
    return Outcome(config.run, delivered, dead, lag, limits, reasons, dict(producer.dead_lettered), member_lag)


async def _unread_lag(run: str, producer: Producer, consumer: Consumer, member_lag: list[int | None]) -> None:
    """Three more records in one partition: the member's lag shows them (the fetcher learns the log end
    in the background) until it reads them."""
    # Sent together, so that they land in one produce request: a fetch answered between two separate
    # sends would buffer the first record, and aiokafka fetches a partition again (learning the new
    # log end) only once its buffer was read, which this member does not do here.
    await asyncio.gather(*(producer.send("trajectories", "late", make_group(f"late-{i}", run=run, n_samples=2,
                                                                            n_tokens=3)) for i in range(3)))
    seen: int | None = None
    loop = asyncio.get_running_loop()
    deadline = loop.time() + scaled(15)
    while seen != 3 and loop.time() < deadline:
        await asyncio.sleep(0.1)
        seen = await consumer.lag()
    member_lag.append(seen)
    late = await poll_until(consumer, 3)
    await consumer.commit(late)
    member_lag.append(await consumer.lag())


def assert_dead_lettered(outcome: Outcome, key: str, reason: str, field: str) -> DeadLetter:
    letter = outcome.dead[key]
    assert letter.reason == reason
    assert letter.field is not None and letter.field.endswith(field)
    assert letter.original_topic == topic_name(outcome.run, "trajectories")
    assert letter.original_partition is not None and letter.original_offset is not None
    assert f"{letter.original_topic}[{letter.original_partition}]@{letter.original_offset}" in letter.message
    assert key in letter.message  # the group id is named
    return letter


def test_token_id_outside_vocab_is_dead_lettered(outcome: Outcome) -> None:
    letter = assert_dead_lettered(outcome, "bad-token-range", "token_range", "completion_ids")
    assert letter.schema == "fleetrl.group/1"
    # The dead letter holds the original bytes: they decode (without bounds) to the group that was sent.
    record = decode_record(letter.value)
    assert record.group_id == "bad-token-range"
    np.testing.assert_array_equal(record.samples[0].completion_ids, [1, 2, VOCAB + 5])  # type: ignore[union-attr]


def test_negative_token_id_is_dead_lettered(outcome: Outcome) -> None:
    assert_dead_lettered(outcome, "bad-negative-token", "token_range", "completion_ids")


def test_too_many_samples_is_dead_lettered(outcome: Outcome) -> None:
    assert_dead_lettered(outcome, "bad-samples", "samples_bound", "samples")


def test_non_finite_logprob_is_dead_lettered(outcome: Outcome) -> None:
    assert_dead_lettered(outcome, "bad-nan-logprob", "logprob_bound", "logprobs")


def test_positive_logprob_is_dead_lettered(outcome: Outcome) -> None:
    assert_dead_lettered(outcome, "bad-positive-logprob", "logprob_bound", "logprobs")


def test_unknown_task_is_dead_lettered(outcome: Outcome) -> None:
    letter = assert_dead_lettered(outcome, "bad-task", "unknown_task", "task")
    assert "no-such-task" in letter.message


def test_undecodable_bytes_are_dead_lettered(outcome: Outcome) -> None:
    letter = outcome.dead["bad-bytes"]
    assert letter.reason == "malformed" and letter.value == b"\xc1 not msgpack"


def test_nothing_is_lost_and_dead_letters_are_committed(outcome: Outcome) -> None:
    # Every produced record is either delivered or dead-lettered, never both, never neither ...
    assert sorted(d.key for d in outcome.delivered if d.key) == sorted(GOOD)
    assert set(outcome.dead) == {*BAD, "bad-bytes"}
    # ... and committing the good ones also covered the dead letters around them: no lag is left.
    assert outcome.lag_after_commit == 0


def test_the_producer_counts_dead_letters_by_reason(outcome: Outcome) -> None:
    expected = {"token_range": 2, "samples_bound": 1, "logprob_bound": 2, "unknown_task": 1, "malformed": 1}
    assert outcome.producer_counts == expected
    assert sorted(outcome.reasons_counted) == sorted(r for r, n in expected.items() for _ in range(n))


def test_a_members_lag_counts_the_records_it_has_not_read(outcome: Outcome) -> None:
    # all read: 0; three produced and not read: 3; read: 0
    assert outcome.member_lag == [0, 3, 0]


async def _flood(bootstrap: str, n_bad: int) -> tuple[list[Delivery], int, list[DeadLetter], int]:
    """`n_bad` undecodable records, then one good group, all in one partition; a consumer polling one
    record at a time. Returns what it delivered, how many polls that read records took (polls that came
    back empty, while the group joined or a fetch was on its way, say nothing of the batching), the dead
    letters and the group's lag after the commit."""
    config = make_config(fleet_yaml(f"t{uuid.uuid4().hex[:10]}", bootstrap))
    await ensure_topics(config, "r1")
    topic = topic_name(config.run, "trajectories")
    async with Producer(config, "r1", "flood-producer") as producer:
        await asyncio.gather(*(producer.send_raw(topic, b"flood", b"\xc1 hostile %d" % i,
                                                 [(SCHEMA_HEADER, b"fleetrl.group/1")]) for i in range(n_bad)))
        await producer.send("trajectories", "flood", make_group("flood-good", run=config.run, n_samples=2, n_tokens=3))
        async with Consumer(config, "r1", ["trajectories"], trainer_group(config.run),
                            RecordLimits.from_config(config), producer, "flood-consumer") as consumer:
            delivered: list[Delivery] = []
            polls = attempts = 0
            loop = asyncio.get_running_loop()
            deadline = loop.time() + scaled(120)
            while not delivered and attempts < 4 * n_bad and loop.time() < deadline:
                dead_before = consumer.dead_count
                got = await consumer.poll(max_records=1, timeout_s=0.5)
                delivered += got
                attempts += 1
                polls += bool(got) or consumer.dead_count > dead_before
            await consumer.commit(delivered)
    letters = await read_dead_letters(config, "r1", limit=2 * n_bad)
    lag = sum(row.lag for row in await group_lag(config, "r1") if row.topic.endswith("trajectories"))
    return delivered, polls, letters, lag


def test_a_flood_of_refused_records_is_dead_lettered_in_batches(tansu: devstack.ServerProcess) -> None:
    """Refused records do not count against a poll's `max_records`: a consumer with room for one group
    behind 600 hostile records reads through them in a few polls (one record per poll would take 601),
    dead-letters every one, and the commit of the good one covers them all."""
    n_bad = 600
    with capture_logs() as logs:
        delivered, polls, letters, lag = asyncio.run(_flood(f"127.0.0.1:{tansu.port}", n_bad))
    assert [d.key for d in delivered] == ["flood"] and delivered[0].record.group_id == "flood-good"
    assert polls < n_bad // 10, polls
    assert len(letters) == n_bad and {dl.reason for dl in letters} == {"malformed"}
    assert sorted(dl.original_offset or 0 for dl in letters) == list(range(n_bad))
    assert lag == 0
    # The log is bounded too, and still accounts for every dead letter.
    lines = [e for e in logs if e["event"] == "record.dead_lettered"]
    summed = [e for e in logs if e["event"] == "record.dead_lettered.suppressed"]
    assert len(lines) <= 20 * (1 + len(summed))
    assert len(lines) + sum(e["count"] for e in summed) == n_bad
    assert all(set(e["by"]) == {"malformed"} for e in summed) and summed


async def _skim(bootstrap: str) -> tuple[list[int], list[str], int]:
    """In one partition: 50 hostile records, a good group, 50 more hostile ones. A member with no room
    for work skims, polls one record, skims again. Returns the dead-letter counts after each skim, the
    groups polled, and the dead letters in the topic."""
    config = make_config(fleet_yaml(f"t{uuid.uuid4().hex[:10]}", bootstrap))
    await ensure_topics(config, "r1")
    topic = topic_name(config.run, "trajectories")
    header = [(SCHEMA_HEADER, b"fleetrl.group/1")]
    async with Producer(config, "r1", "skim-producer") as producer:
        await asyncio.gather(*(producer.send_raw(topic, b"skim", b"\xc1 %d" % i, header) for i in range(50)))
        await producer.send("trajectories", "skim", make_group("skim-good", run=config.run, n_samples=2, n_tokens=3))
        await asyncio.gather(*(producer.send_raw(topic, b"skim", b"\xc1 %d" % i, header) for i in range(50, 100)))
        async with Consumer(config, "r1", ["trajectories"], trainer_group(config.run),
                            RecordLimits.from_config(config), producer, "skim-consumer") as consumer:
            counts: list[int] = []

            async def skim_until(n: int) -> None:  # the first fetch may not have answered yet
                loop = asyncio.get_running_loop()
                deadline = loop.time() + scaled(20)
                while sum(producer.dead_lettered.values()) < n and loop.time() < deadline:
                    await consumer.skim()
                    await asyncio.sleep(0.05)
                for _ in range(3):  # and no further: the good record stops it
                    await consumer.skim()
                counts.append(sum(producer.dead_lettered.values()))

            await skim_until(50)
            polled = await poll_until(consumer, 1, max_records=1)
            await skim_until(100)
            await consumer.commit(polled)
    letters = await read_dead_letters(config, "r1", limit=200)
    return counts, [d.record.group_id for d in polled], len(letters)


def test_skimming_dead_letters_the_head_of_a_partition_and_stops_at_a_good_record(
    tansu: devstack.ServerProcess,
) -> None:
    counts, polled, letters = asyncio.run(_skim(f"127.0.0.1:{tansu.port}"))
    assert counts == [50, 100]  # the first skim stopped at the good group; the second went on after it
    assert polled == ["skim-good"]  # skimming left the good group to be polled
    assert letters == 100


async def _room(bootstrap: str) -> tuple[list[str], list[str], int]:
    """One partition: one hostile record, then 6 good groups interleaved with 20 more hostile ones. A
    poll with room for 2 reads on past the refusals in one large batch, so it holds more good groups
    than it has room for. Returns the groups of that poll, then of the polls after it, and the dead
    letters produced."""
    config = make_config(fleet_yaml(f"t{uuid.uuid4().hex[:10]}", bootstrap))
    await ensure_topics(config, "r1")
    topic = topic_name(config.run, "trajectories")
    header = [(SCHEMA_HEADER, b"fleetrl.group/1")]
    async with Producer(config, "r1", "room-producer") as producer:
        await producer.send_raw(topic, b"room", b"\xc1 first", header)
        for i in range(6):
            group = make_group(f"room-{i}", run=config.run, n_samples=2, n_tokens=3)
            await producer.send("trajectories", "room", group)
            await asyncio.gather(*(producer.send_raw(topic, b"room", b"\xc1 %d %d" % (i, j), header) for j in range(4)))
        async with Consumer(config, "r1", ["trajectories"], trainer_group(config.run),
                            RecordLimits.from_config(config), producer, "room-consumer") as consumer:
            loop = asyncio.get_running_loop()
            deadline = loop.time() + scaled(20)
            first: list[Delivery] = []
            while not first and loop.time() < deadline:
                first = await consumer.poll(max_records=2, timeout_s=0.5)
            rest = await poll_until(consumer, 6 - len(first), max_records=10)
            await consumer.commit(first + rest)
    letters = await read_dead_letters(config, "r1", limit=100)
    return [d.record.group_id for d in first], [d.record.group_id for d in rest], len(letters)


def test_a_poll_that_read_on_past_refusals_puts_back_the_good_records_it_has_no_room_for(
    tansu: devstack.ServerProcess,
) -> None:
    first, rest, letters = asyncio.run(_room(f"127.0.0.1:{tansu.port}"))
    assert len(first) <= 2
    assert first + rest == [f"room-{i}" for i in range(6)]  # each once, in order: none skipped, none twice
    assert letters == 25
