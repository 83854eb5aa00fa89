"""Commit bookkeeping (pure), the bounded retry policy of the Kafka clients, and a commit a rebalance
refused."""

from __future__ import annotations

import pytest
from aiokafka import TopicPartition
from aiokafka import errors as ak_errors

from fleetrl.broker import KafkaError, RecordLimits
from fleetrl.broker.clients import with_retries
from fleetrl.broker.consumer import Consumer, Delivery
from fleetrl.broker.offsets import OffsetTracker
from fleetrl.config import FleetConfig

TP = ("fleetrl.r.trajectories", 0)


def test_commit_point_is_one_past_the_highest_durable_offset() -> None:
    t = OffsetTracker()
    for offset in range(5):
        t.delivered(TP, offset)
    assert t.targets([(TP, 2)]) == {TP: 3}
    t.committed({TP: 3}, [(TP, 2)])
    assert t.positions() == {TP: 3}
    assert t.targets() == {}  # nothing new is durable


def test_dead_letters_after_the_point_are_committed_with_it() -> None:
    t = OffsetTracker()
    t.delivered(TP, 0)
    t.dead(TP, 1)
    t.dead(TP, 2)
    t.delivered(TP, 3)
    # Offsets 1 and 2 were dead-lettered (acknowledged): committing 0 moves the point past them,
    # but not past 3, which is delivered and not durable yet.
    assert t.targets([(TP, 0)]) == {TP: 3}


def test_a_partition_with_only_dead_letters_is_committed_without_deliveries() -> None:
    t = OffsetTracker()
    t.dead(TP, 7)
    t.dead(TP, 8)
    assert t.targets() == {TP: 9}


def test_a_partition_with_only_undurable_deliveries_is_not_committed() -> None:
    t = OffsetTracker()
    t.delivered(TP, 4)
    assert t.targets() == {}


def test_forgotten_partitions_lose_their_bookkeeping() -> None:
    t = OffsetTracker()
    t.dead(TP, 0)
    t.forget([TP])
    assert t.targets() == {} and t.positions() == {}


async def test_retriable_errors_are_retried_a_bounded_number_of_times() -> None:
    calls = 0

    async def flaky() -> str:
        nonlocal calls
        calls += 1
        if calls < 3:
            raise KafkaError("leader moved", retriable=True)
        return "acked"

    assert await with_retries(flaky, what="produce", retries=5, backoff_s=0.001) == "acked"
    assert calls == 3

    async def down() -> None:
        nonlocal calls
        calls += 1
        raise KafkaError("still down", retriable=True)

    calls = 0
    with pytest.raises(KafkaError, match="still down"):
        await with_retries(down, what="produce", retries=2, backoff_s=0.001)
    assert calls == 3  # the first try and two retries


async def test_non_retriable_errors_are_not_retried() -> None:
    calls = 0

    async def refused() -> None:
        nonlocal calls
        calls += 1
        raise KafkaError("authorization failed", retriable=False)

    with pytest.raises(KafkaError):
        await with_retries(refused, what="produce", retries=5, backoff_s=0.001)
    assert calls == 1


class _RebalancedClient:
    """Stands in for the aiokafka consumer inside `Consumer` at the one call under test: it holds the
    partition and its commit fails the way aiokafka's does when the group rebalanced meanwhile (a race
    a test cannot time against a real broker: the window is a heartbeat wide)."""

    def __init__(self, error: Exception) -> None:
        self.error, self.commits = error, 0

    def assignment(self) -> set[TopicPartition]:
        return {TopicPartition(*TP)}

    async def commit(self, offsets: dict[TopicPartition, int]) -> None:
        self.commits += 1
        raise self.error


def _consumer(client: _RebalancedClient) -> Consumer:
    config = FleetConfig.model_validate({"run": "r", "regions": [{"name": "a", "kafka": "127.0.0.1:9",
                                                                   "store": "/tmp/a"}]})
    consumer = Consumer(config, "a", ["trajectories"], "g", RecordLimits.from_config(config),
                        dead_letter=None, client_id="c")  # type: ignore[arg-type]
    consumer._consumer = client  # type: ignore[assignment]
    consumer._tracker.delivered(TP, 0)
    return consumer


def _delivery() -> Delivery:
    return Delivery(topic=TP[0], partition=TP[1], offset=0, key="k", record=None, headers={},  # type: ignore[arg-type]
                    stream="trajectories")


async def test_a_commit_the_group_refuses_after_a_rebalance_is_skipped_not_fatal() -> None:
    # A spot node joining or leaving rebalances the region's group every minute; a worker whose commit
    # raced it died of CommitFailedError. Its partitions are another member's now: skip, as revoked ones.
    client = _RebalancedClient(ak_errors.CommitFailedError("the group has already rebalanced"))
    consumer = _consumer(client)
    await consumer.commit([_delivery()])
    assert client.commits == 1 and consumer.committable_offsets() == {TP: 1}  # nothing committed
    other = _RebalancedClient(ak_errors.KafkaConnectionError("broker gone"))
    with pytest.raises(KafkaError, match="commit group 'g'"):
        await _consumer(other).commit([_delivery()])
