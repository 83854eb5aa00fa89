"""The region agent against real tansu, a real MQTT broker and a directory hub.

* as a process: the retained heartbeat says `up` (with the loaded version), then `offline` after
  SIGTERM, and the process exits 0;
* in-process: `drain` turns the node `draining` and hands its unfinished groups over as partials,
  `resume` starts a fresh worker, `stop` ends the agent.
"""

from __future__ import annotations

import asyncio
import json
import os
import pathlib
import signal
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from regions_testkit import (
    HUB_KEY,
    REGION,
    fleet_dict,
    make_config,
    publish_tiny,
    read_partials,
    send_prompts,
    setup_topics,
    wait_for_beat,
)

from fleetrl.broker import ControlCommand, ControlPlane
from fleetrl.regions import RegionAgent

pytestmark = pytest.mark.integration


@pytest.fixture(autouse=True)
def _env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FLEETRL_HUB_KEY", HUB_KEY)
    torch.set_num_threads(1)


def _scrape(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
        return str(response.read().decode())


@pytest.fixture
def agent_procs() -> Iterator[list[subprocess.Popen[bytes]]]:
    """Agent processes a test starts; any still running at the end are killed by their PID."""
    procs: list[subprocess.Popen[bytes]] = []
    yield procs
    for p in procs:
        if p.poll() is None:
            p.kill()
            p.wait(timeout=10)


async def test_agent_process_heartbeats_up_then_offline_after_sigterm(
    run_id: str, tansu_bootstrap: str, mqtt_server: Any, tmp_path: pathlib.Path,
    agent_procs: list[subprocess.Popen[bytes]],
) -> None:
    data = fleet_dict(run_id, tansu_bootstrap, mqtt_server.port, tmp_path / "store")
    config = make_config(data)
    config_path = tmp_path / "fleet.yaml"
    config_path.write_text(json.dumps(data))
    publish_tiny(config)
    await setup_topics(config)
    env = {**os.environ, "FLEETRL_HUB_KEY": HUB_KEY, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    log_path = tmp_path / "agent.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen([sys.executable, "-m", "fleetrl.cli", "agent", "--config", str(config_path),
                                 "--region", REGION, "--node", "i-0abc123", "--log-json"],
                                stdout=log, stderr=subprocess.STDOUT, env=env)
    agent_procs.append(proc)
    async with ControlPlane(config, f"{run_id}-watcher") as cp:
        beat = await wait_for_beat(cp, "i-0abc123", lambda b: b.state == "up" and b.version == 0, timeout_s=30)
        assert beat.engines == ["torch"]
        proc.send_signal(signal.SIGTERM)
        rc = await asyncio.to_thread(proc.wait, 30)
        assert rc == 0, log_path.read_text()[-2000:]
    # A client that connects now gets the retained state: the agent said goodbye itself.
    async with ControlPlane(config, f"{run_id}-late") as late:
        beat = await wait_for_beat(late, "i-0abc123", lambda b: True, timeout_s=5)
        assert beat.state == "offline"
    events = [json.loads(line) for line in log_path.read_text().splitlines() if line.startswith("{")]
    assert any(e["event"] == "agent.notice" and e["reason"] == "sigterm" for e in events)


async def test_drain_hands_over_unfinished_groups_then_resume_and_stop(
    run_id: str, tansu_bootstrap: str, mqtt_server: Any, tmp_path: pathlib.Path,
) -> None:
    data = fleet_dict(run_id, tansu_bootstrap, mqtt_server.port, tmp_path / "store")
    data["rollout"]["metrics_port"] = 0
    config = make_config(data)
    publish_tiny(config)
    await setup_topics(config)
    # Version 1 never comes: the worker admits these prompts and holds them, unfinished, until the drain.
    sent = await send_prompts(config, 3, min_version=1)
    agent = RegionAgent(config, REGION, "n1", watchers=[])
    run = asyncio.create_task(agent.run())
    try:
        async with ControlPlane(config, f"{run_id}-operator") as cp:
            async with asyncio.timeout(30):
                while agent.worker is None or agent.worker.stats()["groups_in_flight"] < 3:
                    assert not run.done(), run.exception()
                    await asyncio.sleep(0.05)
            await cp.send_control(REGION, ControlCommand(cmd="drain", reason="test"))
            beat = await wait_for_beat(cp, "n1", lambda b: b.state == "draining", timeout_s=10)
            assert beat.tokens_per_s == 0.0
            handed = await read_partials(config, 3, timeout_s=20)
            assert sorted(p.group_id for p in handed) == sorted(sent)
            assert all(p.handed_over_by.node == "n1" and p.handed_over_by.reason == "drain" for p in handed)
            assert not run.done()  # still connected, still draining
            assert agent.metrics_port is not None
            scraped = await asyncio.to_thread(_scrape, agent.metrics_port)
            assert 'fleetrl_agent_state{state="draining"} 1.0' in scraped
            assert "fleetrl_rollout_groups_handed_over_total 3.0" in scraped

            await cp.send_control(REGION, ControlCommand(cmd="resume"))
            await wait_for_beat(cp, "n1", lambda b: b.state == "up", timeout_s=10)
            async with asyncio.timeout(10):
                while agent.workers_started < 2:
                    await asyncio.sleep(0.05)

            await cp.send_control(REGION, ControlCommand(cmd="stop", reason="test over"))
            assert await asyncio.wait_for(run, 30) == "stop"
            await wait_for_beat(cp, "n1", lambda b: b.state == "offline", timeout_s=5)
    finally:
        if not run.done():
            run.cancel()
            await asyncio.gather(run, return_exceptions=True)
