"""tansu with its log in S3 (a moto server) keeps records and committed offsets across a restart."""

from __future__ import annotations

import pytest
from broker_testkit import fleet_yaml, make_config, make_group, poll_until

from fleetrl import devstack
from fleetrl.broker import Consumer, Producer, RecordLimits, ensure_topics, topic_name, trainer_group
from fleetrl.broker.lag import end_offsets

pytestmark = [pytest.mark.integration, pytest.mark.slow]


async def test_committed_records_survive_a_broker_restart(run_id: str, s3_endpoint: str, s3_bucket: str) -> None:
    broker = devstack.tansu(storage=f"s3://{s3_bucket}/", env=devstack.tansu_s3_env(s3_endpoint))
    with broker:
        config = make_config(fleet_yaml(run_id, f"127.0.0.1:{broker.port}", partitions=1))
        limits = RecordLimits.from_config(config)
        group = trainer_group(run_id)
        await ensure_topics(config, "r1")
        async with Producer(config, "r1", "p") as producer:
            for i in range(6):
                await producer.send("trajectories", f"g{i}", make_group(f"g{i}", run=run_id))
            async with Consumer(config, "r1", ["trajectories"], group, limits, producer, "before") as before:
                got = await poll_until(before, 6)
                await before.commit([d for d in got if d.offset < 3])  # effects of g0..g2 are durable

        broker.stop()
        broker.start()

        topic = topic_name(run_id, "trajectories")
        assert await end_offsets(config, "r1", topic) == {0: 6}  # every record is still in the log
        async with Producer(config, "r1", "p") as producer, \
                Consumer(config, "r1", ["trajectories"], group, limits, producer, "after") as after:
            rest = await poll_until(after, 3)
            assert not await after.poll(max_records=10, timeout_s=1.0)
    assert [d.key for d in rest] == ["g3", "g4", "g5"]  # resumed from the committed offset
