"""The agent process through outages and at rest, with its workers as processes.

* the MQTT broker and the region's Kafka (tansu on durable S3 storage, a moto server) are SIGKILLed
  for 20 s and restarted: the agent stays up, reconnects, its workers resume, and every prompt sent
  before, during and after the outage is trained into a group (counted);
* with three versions published at home and copied by the region's replicator (a process), the
  workers pull each announced version from the region store, and an idle worker then makes no more
  store requests in 60 s than the fallback poll (counted from the agent's store-request metrics).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import pathlib
import re
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from fleet_testkit import produce_prompts, read_stream, reverse_prompts
from regions_testkit import (
    HUB_KEY,
    REGION,
    announce,
    fleet_dict,
    make_config,
    metrics_port_from_log,
    publish_tiny,
    send_prompts,
    setup_topics,
    start_agent,
    wait_for_beat,
)
from slowdown import scaled

from fleetrl import devstack
from fleetrl.broker import ControlPlane, GroupRecord
from fleetrl.hub import Hub

pytestmark = [pytest.mark.integration, pytest.mark.slow]


@pytest.fixture(autouse=True)
def _env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FLEETRL_HUB_KEY", HUB_KEY)
    torch.set_num_threads(1)


@pytest.fixture
def procs() -> Iterator[list[subprocess.Popen[bytes]]]:
    mine: list[subprocess.Popen[bytes]] = []
    yield mine
    for p in mine:
        if p.poll() is None:
            p.kill()
            p.wait(timeout=scaled(10))


def _store_requests(port: int) -> dict[str, float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=scaled(5)) as response:
        text = response.read().decode()
    return {op: float(v) for op, v in re.findall(r'fleetrl_rollout_store_requests_total\{op="(\w+)"\} (\S+)', text)}


async def _groups(config: Any, n: int, timeout_s: float) -> set[str]:
    got = await read_stream(config, REGION, "trajectories", n, timeout_s=timeout_s, group=f"{config.run}-count",
                            distinct=True)
    return {d.record.group_id for d in got if isinstance(d.record, GroupRecord)}


async def test_agent_survives_mqtt_and_kafka_down_for_20_s_and_loses_no_prompt(
    run_id: str, s3_endpoint: str, s3_bucket: str, tmp_path: pathlib.Path, procs: list[subprocess.Popen[bytes]],
) -> None:
    kafka = devstack.tansu(storage=f"s3://{s3_bucket}/", env=devstack.tansu_s3_env(s3_endpoint))
    mqtt = devstack.mqtt_broker(workdir=tmp_path)
    with kafka, mqtt:
        data = fleet_dict(run_id, f"127.0.0.1:{kafka.port}", mqtt.port, tmp_path / "store")
        config = make_config(data)
        publish_tiny(config)
        await setup_topics(config)
        proc, log_path = start_agent(data, tmp_path, "n1")
        procs.append(proc)
        async with ControlPlane(config, f"{run_id}-operator") as cp:
            await announce(config, cp, 0)
            await wait_for_beat(cp, "n1", lambda b: b.state == "up" and b.version == 0, timeout_s=90)
        before = await send_prompts(config, 4, min_version=0)
        assert await _groups(config, 4, timeout_s=60) == set(before)

        kafka.kill()
        mqtt.kill()
        await asyncio.sleep(20)
        assert proc.poll() is None, log_path.read_text()[-3000:]  # it rode the outage out
        kafka.start()
        mqtt.start()

        async with ControlPlane(config, f"{run_id}-operator-2") as cp:
            await announce(config, cp, 0)  # this broker keeps no retained state across a restart
            await wait_for_beat(cp, "n1", lambda b: b.state == "up" and b.version == 0, timeout_s=90)
            records = reverse_prompts(config, REGION, 8, n_samples=2, max_new_tokens=8, seed=9)[4:]
            records = [dataclasses.replace(r, group_id=f"{run_id}-after-{i}") for i, r in enumerate(records)]
            after = [r.group_id for r in records]
            await produce_prompts(config, REGION, records)
            got = await _groups(config, 8, timeout_s=120)
        assert got == set(before) | set(after)  # none lost: 4 before the outage, 4 after
        events = [json.loads(line) for line in log_path.read_text().splitlines() if line.startswith("{")]
        assert any(e["event"] == "control.connected" and e["connections"] >= 2 for e in events)


IDLE_S = 20.0
"""How long the idle worker is watched (its store requests counted)."""
FALLBACK_POLL_S = 10.0
"""`rollout.weight_fallback_poll_s` of that test: the only store reads an idle worker may make."""


async def test_workers_pull_announced_versions_and_an_idle_worker_barely_touches_the_store(
    run_id: str, tansu_bootstrap: str, mqtt_server: Any, tmp_path: pathlib.Path,
    procs: list[subprocess.Popen[bytes]],
) -> None:
    data = fleet_dict(run_id, tansu_bootstrap, mqtt_server.port, tmp_path / "home")
    data["regions"][0]["store"] = (tmp_path / "region").as_uri()  # a replica: the replicator fills it
    data["rollout"].update(metrics_port=0, weight_fallback_poll_s=FALLBACK_POLL_S)
    config = make_config(data)
    config_path = tmp_path / "fleet.yaml"
    config_path.write_text(json.dumps(data))
    await setup_topics(config)
    for seed in range(3):
        publish_tiny(config, seed=seed)
    with open(tmp_path / "replicator.log", "wb") as rlog:
        replicator = subprocess.Popen([sys.executable, "-m", "fleetrl.cli", "replicator", "--region", REGION,
                                       "--config", str(config_path), "--log-json"],
                                      stdout=subprocess.DEVNULL, stderr=rlog,
                                      env={**os.environ, "FLEETRL_HUB_KEY": HUB_KEY})
    procs.append(replicator)
    proc, log_path = start_agent(data, tmp_path, "n1")
    procs.append(proc)
    async with ControlPlane(config, f"{run_id}-watcher", watch_replicas=True) as cp:
        await wait_for_beat(cp, "n1", lambda b: b.version == 2, timeout_s=90)
        assert cp.replicas[REGION].version == 2  # announced by the replicator, retained
    port = metrics_port_from_log(log_path)
    pulled = _store_requests(port)
    await asyncio.sleep(IDLE_S)
    idle = _store_requests(port)

    with Hub(config, store=REGION) as hub:
        # what reading the versions the region holds needs (each seed is a new anchor, so a node that joins
        # after them starts at the newest): a manifest and its objects per version
        reading = sum(1 + len(hub.manifest(v).objects) for v in hub.versions())
    polls = int(IDLE_S // FALLBACK_POLL_S) + 1
    assert pulled["list"] == idle["list"] == 0
    assert idle["get"] - pulled["get"] <= polls, (pulled, idle)  # at 0.2 s polling this was 100
    assert idle["get"] <= reading + 1 + polls, (idle, reading)
    print(f"store requests: pull of 3 versions {pulled}, after {IDLE_S:g} s idle {idle}, reading bound {reading}")
