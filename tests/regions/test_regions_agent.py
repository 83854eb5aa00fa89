"""The region agent against real tansu, a real MQTT broker and a directory hub, its workers as processes.

* two engines come `up`; a worker SIGKILLed by the test is restarted and the groups it held are
  redone by the node (nothing lost; duplicates are the trainer's to drop); `fleetrl status --json`
  lists exactly the agents started, their engines, and a SIGKILLed agent as offline;
* a worker that crashes at start goes `crashloop` in the heartbeat (with its error line), /healthz
  says so, and the agent stays up and exits 0 on SIGTERM;
* in-process: `drain` hands every unfinished group over as partials and stops the workers, `resume`
  starts them again, `stop` ends the agent.
"""

from __future__ import annotations

import asyncio
import json
import os
import pathlib
import signal
import subprocess
import sys
import urllib.error
import urllib.request
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from fleet_testkit import read_stream
from regions_testkit import (
    HUB_KEY,
    REGION,
    announce,
    engines_of,
    fleet_dict,
    make_config,
    metrics_port_from_log,
    publish_tiny,
    read_partials,
    send_prompts,
    setup_topics,
    start_agent,
    wait_for_beat,
)
from slowdown import scaled

from fleetrl.broker import ControlCommand, ControlPlane, GroupRecord
from fleetrl.regions import RegionAgent

pytestmark = pytest.mark.integration


@pytest.fixture(autouse=True)
def _env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FLEETRL_HUB_KEY", HUB_KEY)
    torch.set_num_threads(1)


def _get(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=scaled(5)) as response:
            return int(response.status), str(response.read().decode())
    except urllib.error.HTTPError as exc:
        return int(exc.code), str(exc.read().decode())


@pytest.fixture
def started() -> Iterator[dict[str, Any]]:
    """Agent processes (`agents`) and worker PIDs (`workers`) a test started; killed at the end by PID."""
    mine: dict[str, Any] = {"agents": [], "workers": set()}
    yield mine
    for p in mine["agents"]:
        if p.poll() is None:
            p.kill()
            p.wait(timeout=scaled(10))
    for pid in mine["workers"]:
        try:
            cmdline = pathlib.Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue
        if b"fleetrl.rollout" in cmdline:
            os.kill(pid, signal.SIGKILL)


async def test_two_workers_a_killed_one_is_restarted_and_its_groups_redone_and_status_lists_the_agents(
    run_id: str, tansu_bootstrap: str, mqtt_server: Any, tmp_path: pathlib.Path, started: dict[str, Any],
) -> None:
    data = fleet_dict(run_id, tansu_bootstrap, mqtt_server.port, tmp_path / "store")
    data["kafka"]["partitions"]["prompts"] = 4
    data["regions"][0]["engine"]["devices"] = ["cpu", "cpu"]
    data["regions"][0]["nodes"] = [{"name": "n1"}, {"name": "n2", "engine": {"kind": "torch", "max_batch": 8}}]
    config = make_config(data)
    publish_tiny(config)
    await setup_topics(config)
    for node in ("n1", "n2"):
        proc, _ = start_agent(data, tmp_path, node)
        started["agents"].append(proc)
    n1, n2 = started["agents"]
    async with ControlPlane(config, f"{run_id}-watcher") as cp:
        await announce(config, cp, 0)
        beat = await wait_for_beat(cp, "n1", lambda b: b.state == "up" and b.version == 0 and len(engines_of(b)) == 2
                                   and all(e.state == "up" for e in engines_of(b)), timeout_s=90)
        await wait_for_beat(cp, "n2", lambda b: b.state == "up" and b.version == 0, timeout_s=60)
        for b in (beat, cp.nodes[(REGION, "n2")]):
            started["workers"].update(e.pid for e in engines_of(b))
        # Version 1 is not out yet: the prompts are admitted and held (min_version), uncommitted.
        sent = await send_prompts(config, 8, min_version=1)
        held = await wait_for_beat(cp, "n1", lambda b: any(e.in_flight > 0 for e in engines_of(b)), timeout_s=60)
        victim = next(e for e in engines_of(held) if e.in_flight > 0)
        os.kill(victim.pid, signal.SIGKILL)
        restarted = await wait_for_beat(cp, "n1", lambda b: engines_of(b)[victim.index].restarts == 1
                                        and engines_of(b)[victim.index].state == "up", timeout_s=90)
        new_pid = engines_of(restarted)[victim.index].pid
        started["workers"].add(new_pid)
        assert new_pid != victim.pid and n1.poll() is None

        publish_tiny(config, seed=1)
        await announce(config, cp, 1)
        done = await read_stream(config, REGION, "trajectories", len(sent), timeout_s=120, distinct=True)
        got = {d.record.group_id for d in done if isinstance(d.record, GroupRecord)}
        assert got == set(sent)  # nothing lost: the killed worker's groups were redone

        n2.kill()  # the last will says offline; its worker sees its pipe close and hands over
        await wait_for_beat(cp, "n2", lambda b: b.state == "offline", timeout_s=30)
    status = await asyncio.to_thread(subprocess.run, [
        sys.executable, "-m", "fleetrl.cli", "status", "--json", "--config", str(tmp_path / "fleet-n1.yaml"),
        "--wait-s", str(scaled(20))],  # ends once n1's and n2's beats are in
        capture_output=True, text=True, timeout=scaled(60))
    assert status.returncode == 0, status.stderr
    nodes = {n["node"]: n for n in json.loads(status.stdout)["nodes"]}
    assert set(nodes) == {"n1", "n2"}
    assert nodes["n1"]["state"] == "up" and [e["state"] for e in nodes["n1"]["engines"]] == ["up", "up"]
    assert nodes["n2"]["state"] == "offline"
    n1.send_signal(signal.SIGTERM)
    assert await asyncio.to_thread(n1.wait, scaled(60)) == 0


async def test_a_worker_that_crashes_at_start_goes_crashloop_and_the_agent_stays_up(
    run_id: str, tansu_bootstrap: str, mqtt_server: Any, tmp_path: pathlib.Path, started: dict[str, Any],
) -> None:
    data = fleet_dict(run_id, tansu_bootstrap, mqtt_server.port, tmp_path / "store")
    data["regions"][0]["engine"]["devices"] = ["no-such-device"]
    data["rollout"]["metrics_port"] = 0
    config = make_config(data)
    publish_tiny(config)
    await setup_topics(config)
    proc, log_path = start_agent(data, tmp_path, "n1")
    started["agents"].append(proc)
    async with ControlPlane(config, f"{run_id}-watcher") as cp:
        beat = await wait_for_beat(cp, "n1", lambda b: engines_of(b)[0].state == "crashloop", timeout_s=90)
        engine = engines_of(beat)[0]
        assert beat.state == "up" and proc.poll() is None  # the agent itself is fine
        assert "no-such-device" in engine.last_error, engine.last_error
        code, body = await asyncio.to_thread(_get, f"http://127.0.0.1:{metrics_port_from_log(log_path)}/healthz")
        assert code == 503 and json.loads(body)["engines"][0]["state"] == "crashloop"
        proc.send_signal(signal.SIGTERM)
        assert await asyncio.to_thread(proc.wait, scaled(30)) == 0
        await wait_for_beat(cp, "n1", lambda b: b.state == "offline", timeout_s=10)
    events = [json.loads(line) for line in log_path.read_text().splitlines() if line.startswith("{")]
    assert sum(e["event"] == "agent.worker_started" for e in events) >= 2  # it was retried, not given up on


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
            await announce(config, cp, 0)
            await wait_for_beat(cp, "n1", lambda b: b.in_flight == 3, timeout_s=60)
            await cp.send_control(REGION, ControlCommand(cmd="drain", reason="test"))
            beat = await wait_for_beat(cp, "n1", lambda b: b.state == "draining", timeout_s=10)
            assert beat.tokens_per_s == 0.0
            # What the trainer prices it by (docs/cost.md): its capacity type and how long it has run.
            assert beat.capacity == "on_demand" and beat.started_at is not None and beat.started_at <= beat.ts
            handed = await read_partials(config, 3, timeout_s=30)
            assert sorted(p.group_id for p in handed) == sorted(sent)
            assert all(p.handed_over_by.node == "n1" and p.handed_over_by.reason == "drain" for p in handed)
            await wait_for_beat(cp, "n1", lambda b: engines_of(b)[0].state == "stopped", timeout_s=30)
            assert not run.done()  # still connected, still draining
            assert agent.metrics_port is not None
            code, scraped = await asyncio.to_thread(_get, f"http://127.0.0.1:{agent.metrics_port}/metrics")
            assert code == 200 and 'fleetrl_agent_state{state="draining"} 1.0' in scraped
            assert "fleetrl_rollout_groups_handed_over_total 3.0" in scraped

            await cp.send_control(REGION, ControlCommand(cmd="resume"))
            await wait_for_beat(cp, "n1", lambda b: b.state == "up" and engines_of(b)[0].state == "up", timeout_s=60)

            await cp.send_control(REGION, ControlCommand(cmd="stop", reason="test over"))
            assert await asyncio.wait_for(run, scaled(60)) == "stop"
            await wait_for_beat(cp, "n1", lambda b: b.state == "offline", timeout_s=5)
    finally:
        if not run.done():
            run.cancel()
            await asyncio.gather(run, return_exceptions=True)
