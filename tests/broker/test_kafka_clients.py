"""Producer and Consumer against a real tansu: round trip, size refusal, commit-after-effect, priority."""

from __future__ import annotations

import asyncio
import uuid
from typing import Any

import numpy as np
import pytest
from aiokafka import AIOKafkaConsumer, TopicPartition
from aiokafka.abc import ConsumerRebalanceListener
from broker_testkit import fleet_yaml, make_config, make_group, make_prompt, poll_until
from slowdown import scaled

from fleetrl import devstack
from fleetrl.broker import (
    SCHEMA_HEADER,
    Consumer,
    GroupRecord,
    Producer,
    RecordLimits,
    RecordTooLarge,
    Stream,
    ensure_topics,
    rollout_group,
    topic_name,
    trainer_group,
)
from fleetrl.broker.assignor import RendezvousAssignor
from fleetrl.broker.clients import stop_client
from fleetrl.broker.errors import KafkaError
from fleetrl.broker.lag import end_offsets
from fleetrl.config import FleetConfig

pytestmark = pytest.mark.integration


async def test_groups_round_trip_with_schema_header(fleet_config: FleetConfig, limits: RecordLimits) -> None:
    await ensure_topics(fleet_config, "r1")
    sent = [make_group(f"g{i}", run=fleet_config.run, n_samples=3, n_tokens=7) for i in range(5)]
    async with Producer(fleet_config, "r1", "test-producer") as producer:
        for group in sent:
            await producer.send("trajectories", group.group_id, group)
        async with Consumer(fleet_config, "r1", ["trajectories"], trainer_group(fleet_config.run), limits,
                            producer, "test-consumer") as consumer:
            got = await poll_until(consumer, len(sent))
    assert sorted(d.key for d in got) == sorted(g.group_id for g in sent)
    by_id = {g.group_id: g for g in sent}
    for d in got:
        assert d.topic == topic_name(fleet_config.run, "trajectories") and d.stream == "trajectories"
        assert d.headers[SCHEMA_HEADER] == b"fleetrl.group/1"
        assert isinstance(d.record, GroupRecord)
        want = by_id[d.record.group_id]
        for a, b in zip(d.record.samples, want.samples, strict=True):
            np.testing.assert_array_equal(a.completion_ids, b.completion_ids)
            np.testing.assert_array_equal(a.logprobs, b.logprobs)


async def test_record_over_max_message_bytes_is_refused_before_sending(fleet_config: FleetConfig) -> None:
    await ensure_topics(fleet_config, "r1")
    # 4 samples x 40,000 tokens x 8 bytes is about 1.3 MB, over the 1 MiB limit of this config.
    big = make_group("too-big-1", run=fleet_config.run, n_samples=4, n_tokens=40_000)
    topic = topic_name(fleet_config.run, "trajectories")
    async with Producer(fleet_config, "r1", "test-producer") as producer:
        with pytest.raises(RecordTooLarge) as info:
            await producer.send("trajectories", big.group_id, big)
    assert "too-big-1" in str(info.value) and str(info.value.size) in str(info.value)
    assert info.value.size > fleet_config.kafka.max_message_bytes == info.value.limit
    assert sum((await end_offsets(fleet_config, "r1", topic)).values()) == 0


async def test_uncommitted_records_go_to_the_next_member(fleet_config: FleetConfig, limits: RecordLimits) -> None:
    await ensure_topics(fleet_config, "r1")
    group = rollout_group(fleet_config.run)
    async with Producer(fleet_config, "r1", "test-producer") as producer:
        for i in range(12):
            await producer.send("prompts", f"p{i}", make_prompt(f"p{i}", run=fleet_config.run))
        async with Consumer(fleet_config, "r1", ["prompts"], group, limits, producer, "first") as first:
            got = await poll_until(first, 12)
            assert len(got) == 12
            # Only the effects of partitions 0 and 1 became durable; the rest is never committed.
            durable = [d for d in got if d.partition in (0, 1)]
            await first.commit(durable)
        async with Consumer(fleet_config, "r1", ["prompts"], group, limits, producer, "second") as second:
            again = await poll_until(second, 12 - len(durable), timeout_s=20)
            assert not await second.poll(max_records=100, timeout_s=1.0)
    assert sorted(d.key for d in again) == sorted(d.key for d in got if d.partition not in (0, 1))


async def test_partials_are_consumed_before_prompts(fleet_config: FleetConfig, limits: RecordLimits) -> None:
    await ensure_topics(fleet_config, "r1")
    run = fleet_config.run
    async with Producer(fleet_config, "r1", "test-producer") as producer:
        for i in range(6):
            await producer.send("prompts", f"p{i}", make_prompt(f"p{i}", run=run))
        for i in range(5):
            await producer.send("partials", f"h{i}", _partial(f"h{i}", run))
        async with Consumer(fleet_config, "r1", ["partials", "prompts"], rollout_group(run), limits, producer,
                            "prio", priority=True) as consumer:
            order = [d.stream for d in await poll_until(consumer, 11, max_records=2)]
            assert order == ["partials"] * 5 + ["prompts"] * 6
            # A partial handed over later still overtakes prompts produced earlier.
            for i in range(6, 9):
                await producer.send("prompts", f"p{i}", make_prompt(f"p{i}", run=run))
            await producer.send("partials", "h-late", _partial("h-late", run))
            later = await poll_until(consumer, 4, max_records=1)
    assert later[0].key == "h-late"
    assert sorted(d.key for d in later[1:]) == ["p6", "p7", "p8"]


async def test_a_priority_poll_survives_partitions_revoked_under_it(
    fleet_config: FleetConfig, limits: RecordLimits
) -> None:
    """The priority poll asks each partials partition's position after an await: in a region whose
    members come and go every few seconds, a rebalance revokes some of them in between. Such a partition
    is no longer this member's to read (no backlog here, no lag): before, aiokafka's IllegalStateError
    killed the rollout worker (9 of 19 spot workers in one `bench/pipeline.py --cost` run)."""
    await ensure_topics(fleet_config, "r1")
    run = fleet_config.run
    async with Producer(fleet_config, "r1", "test-producer") as producer:
        for i in range(4):
            await producer.send("partials", f"h{i}", _partial(f"h{i}", run))
        streams: list[Stream] = ["partials", "prompts"]
        async with (
            Consumer(fleet_config, "r1", streams, rollout_group(run), limits, producer, "kept", priority=True) as kept,
            Consumer(fleet_config, "r1", streams, rollout_group(run), limits, producer, "visitor",
                     priority=True) as visitor,
        ):
            deadline = asyncio.get_running_loop().time() + scaled(60)
            while kept.assignment() & visitor.assignment() or not kept.assignment():
                assert asyncio.get_running_loop().time() < deadline, "the group never settled"
                await kept.poll(max_records=1, timeout_s=0.2)
            gone = [TopicPartition(t, p) for t, p in visitor.assignment()]
            assert not await kept._has_backlog(gone)  # not held: nothing for this member to read
            polled = await kept.poll(max_records=4, timeout_s=1.0)  # reads on, from what it still holds
            assert {d.tp for d in polled} <= kept.assignment()


class _HeldRevoke(ConsumerRebalanceListener):
    """A member that does not rejoin until the test lets it: the group's rebalance waits for it."""

    def __init__(self) -> None:
        self.release, self.revoking = asyncio.Event(), asyncio.Event()

    async def on_partitions_revoked(self, revoked: Any) -> None:
        if not revoked:  # the first join revokes nothing
            return
        self.revoking.set()
        await asyncio.wait_for(self.release.wait(), timeout=scaled(60))

    async def on_partitions_assigned(self, assigned: Any) -> None:
        pass


async def test_a_poll_that_a_rebalance_outlasts_comes_back_empty(run_id: str, tansu_bootstrap: str) -> None:
    """aiokafka's getmany waits, unbounded, while a rebalance assigns; in a region whose members change
    every few seconds one outlasted the poll's bound and the worker died of "no answer" (cost bench).
    Here an old member holds the rebalance in its revocation until the test releases it, so the new
    member's polls meet a rebalance longer than their bound by construction: they come back empty
    (counted, `consumer.rebalance_slow`) and the member lives on; one still held at the next bound
    (`MAX_REBALANCE_WAITS`) raises, so that a stuck member is replaced. (Its join itself is held too, past
    the 5 s request timeout this test sets to keep polls short; tansu then did not take it in within
    a minute after the old member left, which is why the fleet's request timeout stays far above a
    join's hold.)"""
    data = fleet_yaml(run_id, tansu_bootstrap)
    data["kafka"]["request_timeout_s"] = 5.0  # a poll's bound: 5 s + its own wait
    config = make_config(data)
    await ensure_topics(config, "r1")
    limits = RecordLimits.from_config(config)
    group, streams = rollout_group(run_id), list[Stream](["partials", "prompts"])
    held = _HeldRevoke()
    old = AIOKafkaConsumer(bootstrap_servers=tansu_bootstrap, group_id=group, session_timeout_ms=30_000,
                           rebalance_timeout_ms=30_000,
                           partition_assignment_strategy=(RendezvousAssignor,))  # the fleet's default
    old.subscribe([topic_name(run_id, t) for t in streams], listener=held)
    try:
        await asyncio.wait_for(old.start(), timeout=scaled(60))  # joined and assigned
        async with (
            Producer(config, "r1", "test-producer") as producer,
            Consumer(config, "r1", streams, group, limits, producer, "new", join_in_background=True) as new,
        ):
            for _ in range(6):  # the old member holds the rebalance: each poll outlasts its bound
                assert await new.poll(max_records=10, timeout_s=0.2) == []
                if new.rebalance_waits:
                    break
            assert held.revoking.is_set() and new.rebalance_waits == 1 and not new.assignment()
            # Still held at the next bound: stuck, not slow. The error goes up (the worker restarts
            # and joins as a new member) instead of waiting on a rebalance that may never end.
            with pytest.raises(KafkaError, match="no answer"):
                await new.poll(max_records=10, timeout_s=0.2)
    finally:
        held.release.set()
        await old.stop()


async def test_seek_resumes_from_checkpointed_offsets(fleet_config: FleetConfig, limits: RecordLimits) -> None:
    await ensure_topics(fleet_config, "r1")
    group = trainer_group(fleet_config.run)
    async with Producer(fleet_config, "r1", "test-producer") as producer:
        for i in range(8):
            g = make_group(f"g{i}", run=fleet_config.run)
            await producer.send("trajectories", g.group_id, g)
        async with Consumer(fleet_config, "r1", ["trajectories"], group, limits, producer, "a") as a:
            got = await poll_until(a, 8)
            trained = [d for d in got if d.offset == 0]
            checkpoint = a.committable_offsets(trained)  # what the trainer writes into its checkpoint
        assert checkpoint == {d.tp: 1 for d in trained}
        async with Consumer(fleet_config, "r1", ["trajectories"], group, limits, producer, "b") as b:
            b.seek(checkpoint)
            rest = await poll_until(b, 8 - len(trained))
    assert sorted(d.key for d in rest) == sorted(d.key for d in got if d.offset != 0)


def _partial(group_id: str, run: str) -> object:
    from fleetrl.broker import HandedOverBy, PartialRecord, PartialSample, floats, ids

    sample = PartialSample(ids([5, 6]), floats([-0.5, -0.25]), ids([0, 0]))
    return PartialRecord(prompt=make_prompt(group_id, run=run), samples=[sample],
                         handed_over_by=HandedOverBy(region="r1", node="n1", reason="preempted"))


async def test_closing_a_consumer_whose_broker_just_died_raises_nothing(limits: RecordLimits) -> None:
    """aiokafka's fetcher, closing, awaits the fetch task it cancelled while that task waited out its
    retry backoff (its broker gone), and so leaked the CancelledError out of `stop()`: a trainer that
    had drained and checkpointed died on it at exit. `close()` now returns; a real cancel still works."""
    server = devstack.tansu().start()
    try:
        config = make_config(fleet_yaml(f"t{uuid.uuid4().hex[:10]}", f"127.0.0.1:{server.port}",
                                        kafka={"retry_backoff_s": 5.0}))
        await ensure_topics(config, "r1")
        async with Producer(config, "r1", "dying-producer") as producer:
            await producer.send("trajectories", "k", make_group("g0", run=config.run, n_samples=2, n_tokens=3))
            consumer = await Consumer(config, "r1", ["trajectories"], trainer_group(config.run), limits, producer,
                                      "dying-consumer").start()
            assert await poll_until(consumer, 1)
            server.kill()
            await asyncio.sleep(2.0)  # the fetcher's next request fails and it sleeps its 5 s backoff
            await consumer.close()  # raised CancelledError before

        async def stopping() -> None:
            await stop_client(asyncio.sleep(3600), 5.0, "a slow stop")

        waiter = asyncio.create_task(stopping())
        await asyncio.sleep(0.1)
        waiter.cancel()
        with pytest.raises(asyncio.CancelledError):  # a cancel of the caller itself is not swallowed
            await waiter
    finally:
        server.stop()
