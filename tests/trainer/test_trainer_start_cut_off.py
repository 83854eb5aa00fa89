"""A trainer started while every region is cut off waits for the first to answer, then trains.

The packaged units restart a trainer that exits on a failure (`Restart=on-failure`), so a trainer
SIGKILLed and restarted during a partition must not treat "no region answers yet" as fatal: it waits,
with backoff and a `trainer.waiting_for_regions` log line per attempt, within `trainer.start_timeout_s`.
Here the region's Kafka is not listening at all when `fleetrl trainer` starts (connections refused, as
across a cut link), and comes up once the trainer has retried twice.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
from collections.abc import Callable
from typing import Any

import pytest
import yaml
from slowdown import scaled
from trainer_groups import HUB_KEY, answer_prompts

from fleetrl import devstack
from fleetrl.broker import ensure_topics
from fleetrl.config import FleetConfig

pytestmark = [pytest.mark.integration]
REGION = "local-a"
STEPS = 2


async def _events_until(stream: asyncio.StreamReader, events: list[dict[str, Any]], want: str, count: int,
                        timeout_s: float) -> None:
    """Read the daemon's JSON log into `events` until `want` was logged `count` times (or it exited)."""
    async with asyncio.timeout(timeout_s):
        while sum(e.get("event") == want for e in events) < count and (line := await stream.readline()):
            try:
                events.append(json.loads(line))
            except ValueError:
                events.append({"event": "raw", "line": line.decode(errors="replace")})


async def test_a_trainer_started_while_every_region_is_cut_off_trains_once_one_answers(
        make_fleet: Callable[..., FleetConfig], tmp_path: Any) -> None:
    port = devstack.free_port()  # nothing listens there until the test starts the region's broker
    doc = make_fleet().model_dump(mode="json")
    doc["regions"][0]["kafka"]["bootstrap"] = f"127.0.0.1:{port}"
    doc["trainer"]["start_timeout_s"] = scaled(300)
    config = FleetConfig.model_validate(doc)
    cfg = tmp_path / "fleet.yaml"
    cfg.write_text(yaml.safe_dump(config.model_dump(mode="json")))
    env = {**os.environ, "FLEETRL_HUB_KEY": HUB_KEY, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "fleetrl.cli", "trainer", "--config", str(cfg), "--steps", str(STEPS), "--log-json",
        stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.PIPE, env=env)
    assert proc.stderr is not None
    events: list[dict[str, Any]] = []
    finished = asyncio.Event()
    rollout: asyncio.Task[None] | None = None
    try:
        await _events_until(proc.stderr, events, "trainer.waiting_for_regions", 2, scaled(120))
        assert proc.returncode is None, f"the trainer exited {proc.returncode} while the region was cut: {events[-5:]}"
        waits = [e for e in events if e.get("event") == "trainer.waiting_for_regions"]
        assert [w["attempt"] for w in waits] == [1, 2] and REGION in waits[0]["errors"]
        assert waits[1]["retry_in_s"] > waits[0]["retry_in_s"]  # it backs off
        with devstack.tansu(port):  # the region answers again
            await ensure_topics(config, REGION)
            answered: list[str] = []
            rollout = asyncio.create_task(answer_prompts(config, REGION, finished.is_set, answered))
            await _events_until(proc.stderr, events, "trainer.finished", 1, scaled(180))
            rc = await asyncio.wait_for(proc.wait(), scaled(60))
            finished.set()
            await asyncio.wait_for(rollout, scaled(30))
    finally:
        finished.set()
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
        if rollout is not None and not rollout.done():
            rollout.cancel()
    assert rc == 0, [e for e in events if e.get("level") == "error"] or events[-5:]
    assert [e["step"] for e in events if e.get("event") == "step.done"] == list(range(1, STEPS + 1))
    connected = [e for e in events if e.get("event") == "trainer.clients_ready"]
    assert len(connected) == 1 and connected[0]["regions"] == [REGION]
