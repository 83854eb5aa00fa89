"""Consumer groups on a real tansu: members split partitions; a member killed before commit loses nothing."""

from __future__ import annotations

import asyncio
import json
import os
import pathlib
import signal
import subprocess
import sys

import pytest
from broker_testkit import fleet_yaml, make_config, make_prompt, poll_until, write_config
from slowdown import scaled

from fleetrl.broker import Consumer, Producer, RecordLimits, ensure_topics, rollout_group
from fleetrl.config import FleetConfig

pytestmark = pytest.mark.integration
HERE = pathlib.Path(__file__).parent


async def test_two_members_split_the_partitions(fleet_config: FleetConfig, limits: RecordLimits) -> None:
    await ensure_topics(fleet_config, "r1")
    group = rollout_group(fleet_config.run)
    async with Producer(fleet_config, "r1", "p") as producer, \
            Consumer(fleet_config, "r1", ["prompts"], group, limits, producer, "a", heartbeat_interval_s=0.3) as a, \
            Consumer(fleet_config, "r1", ["prompts"], group, limits, producer, "b", heartbeat_interval_s=0.3) as b:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + scaled(40)
        while loop.time() < deadline and not (a.assignment() and b.assignment()):
            await asyncio.gather(a.poll(10, 0.2), b.poll(10, 0.2))
        assert a.assignment() and b.assignment(), "the second member never got partitions"
        assert not a.assignment() & b.assignment()
        assert len(a.assignment() | b.assignment()) == fleet_config.kafka.partitions.prompts
        for i in range(24):
            await producer.send("prompts", f"p{i}", make_prompt(f"p{i}", run=fleet_config.run))
        got_a: list[str] = []
        got_b: list[str] = []
        while loop.time() < deadline and len(got_a) + len(got_b) < 24:
            da, db = await asyncio.gather(a.poll(100, 0.3), b.poll(100, 0.3))
            got_a += [d.key for d in da]
            got_b += [d.key for d in db]
    assert got_a and got_b
    assert sorted(got_a + got_b) == sorted(f"p{i}" for i in range(24))  # each record once, none lost


async def test_member_killed_before_commit_leaves_its_records_to_the_group(
    run_id: str, tansu_bootstrap: str, tmp_path: pathlib.Path
) -> None:
    data = fleet_yaml(run_id, tansu_bootstrap)
    path = write_config(data, tmp_path / "fleet.yaml")
    config = make_config(data)
    limits = RecordLimits.from_config(config)
    await ensure_topics(config, "r1")
    group = rollout_group(run_id)
    async with Producer(config, "r1", "p") as producer:
        for i in range(10):
            await producer.send("prompts", f"p{i}", make_prompt(f"p{i}", run=run_id))
    member = subprocess.Popen([sys.executable, str(HERE / "kafka_member.py"), str(path), group, "10"],
                              stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        line = await asyncio.wait_for(asyncio.to_thread(member.stdout.readline), timeout=scaled(60))  # type: ignore[union-attr]
        assert json.loads(line) == sorted(f"p{i}" for i in range(10))
    finally:
        os.kill(member.pid, signal.SIGKILL)
        member.wait(timeout=scaled(10))
        member.stdout.close()  # type: ignore[union-attr]
    async with Producer(config, "r1", "dlq") as dlq, Consumer(
        config, "r1", ["prompts"], group, limits, dlq, "survivor", heartbeat_interval_s=0.3
    ) as survivor:
        again = await poll_until(survivor, 10, timeout_s=40)
    assert sorted(d.key for d in again) == sorted(f"p{i}" for i in range(10))
