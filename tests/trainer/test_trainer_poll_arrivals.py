"""The trainer wakes on arrivals: a region waiting for its first record does not hold back another.

Two regions on two real tansu brokers. Nothing here asserts on speed: the quiet region's poll waits
longer than the test's own bound, so only an early return can pass.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterator

import pytest
from slowdown import scaled
from trainer_groups import make_group

from fleetrl import devstack
from fleetrl.broker import Producer, RecordLimits, ensure_topics, trainer_group
from fleetrl.config import FleetConfig
from fleetrl.trainer.regions import RegionClients

pytestmark = [pytest.mark.integration]
QUIET_POLL_S = scaled(60.0)
"""The poll timeout: longer than the bound on each `poll` call below, so waiting it out fails (both scaled by
the machine's slowdown, the bound staying half of it)."""


@pytest.fixture(scope="module")
def second_tansu() -> Iterator[devstack.ServerProcess]:
    with devstack.tansu() as server:
        yield server


async def test_a_poll_returns_with_one_regions_arrivals_while_another_waits(
        make_fleet: Callable[..., FleetConfig], second_tansu: devstack.ServerProcess) -> None:
    base = make_fleet()
    data = base.model_dump(mode="json")
    data["regions"].append({**data["regions"][0], "name": "local-b",
                            "kafka": {"bootstrap": f"127.0.0.1:{second_tansu.port}"}, "nodes": []})
    config = FleetConfig.model_validate(data)
    for region in ("local-a", "local-b"):
        await ensure_topics(config, region)
    limits = RecordLimits.from_config(config)
    async with RegionClients(config, limits, trainer_group(config.run), {}) as clients, \
            Producer(config, "local-a", "side-a") as side_a, Producer(config, "local-b", "side-b") as side_b:
        await side_a.send("trajectories", "g-a", make_group("g-a", config.run, n=2))
        got: dict[str, list[str]] = {}
        deadline = time.monotonic() + scaled(60)
        while "local-a" not in got and time.monotonic() < deadline:
            out = await asyncio.wait_for(clients.poll(16, QUIET_POLL_S), QUIET_POLL_S / 2)
            got.update({r: [d.record.group_id for d in ds] for r, ds in out.items() if ds})  # type: ignore[union-attr]
        assert got == {"local-a": ["g-a"]}  # returned with a's record; b's poll is still out
        # the quiet region's poll stays in flight and hands over what arrives later
        await side_b.send("trajectories", "g-b", make_group("g-b", config.run, n=2))
        deadline = time.monotonic() + scaled(60)
        while "local-b" not in got and time.monotonic() < deadline:
            out = await asyncio.wait_for(clients.poll(16, QUIET_POLL_S), QUIET_POLL_S / 2)
            got.update({r: [d.record.group_id for d in ds] for r, ds in out.items() if ds})  # type: ignore[union-attr]
        assert got == {"local-a": ["g-a"], "local-b": ["g-b"]}
