"""Helpers of the region-agent tests: a one-region fleet on real tansu + MQTT and a directory hub."""

from __future__ import annotations

import asyncio
import pathlib
import time
from collections.abc import Callable
from typing import Any

import yaml
from fleet_testkit import produce_prompts, read_stream, reverse_prompts
from fleet_testkit import publish_tiny as publish_tiny  # re-exported for the tests
from slowdown import scaled

from fleetrl.broker import ControlPlane, Heartbeat, PartialRecord, PolicyAnnouncement, ensure_topics
from fleetrl.config import FleetConfig, parse_config
from fleetrl.hub import Hub

HUB_KEY = "370914670d656bbd9a9f2ab7ccbd7fd90a2a1c55151520334b409cee29d7820f"  # Ed25519 private key (hex)
REGION = "r1"


def fleet_dict(run_id: str, bootstrap: str, mqtt_port: int, store: pathlib.Path) -> dict[str, Any]:
    """One region whose store is the home store (no replicator needed); fast heartbeats."""
    return {
        "run": run_id,
        "algorithm": {"n_samples": 2, "max_new_tokens": 8},
        "dataset": {"task": "reverse"},
        "hub": {"home_store": store.as_uri(), "threads": 1, "poll_interval_s": 0.1},
        "mqtt": {"url": f"mqtt://127.0.0.1:{mqtt_port}", "heartbeat_interval_s": 0.2, "keepalive_s": 5},
        "kafka": {"partitions": {"prompts": 1, "partials": 1, "trajectories": 1, "dead_letter": 1},
                  "max_message_bytes": 1024 * 1024, "retries": 2},
        "rollout": {"weight_fallback_poll_s": 30.0, "idle_poll_s": 0.1, "handover_timeout_s": 10.0,
                    "min_version_wait_s": 60.0},
        # hang detection is not what these tests check: its bounds are ones only a hang reaches, also
        # for a worker that takes minutes to import torch on cores shared with a whole suite (60 s
        # was reached at load ~25, and the worker was restarted as hung); so they are scaled by the
        # machine's slowdown like the tests' own hang bounds
        "agent": {"progress_interval_s": 0.5, "restart_backoff_s": 0.2, "restart_backoff_max_s": 2.0,
                  "crashloop_after": 2, "hang_timeout_s": scaled(90.0), "start_timeout_s": scaled(180.0)},
        "regions": [{"name": REGION, "kafka": bootstrap, "store": store.as_uri(),
                     "engine": {"kind": "torch", "max_batch": 8}}],
    }


def make_config(data: dict[str, Any]) -> FleetConfig:
    return parse_config(yaml.safe_dump(data), source="regions-test.yaml", env={})


async def announce(config: FleetConfig, cp: ControlPlane, version: int) -> None:
    """Announce a published version as the trainer does (retained policy): the agents pull it."""
    with Hub.from_config(config) as hub:
        m = hub.manifest(version)
    await cp.announce_policy(PolicyAnnouncement(version=version, manifest=f"{config.run}/versions/{version:012d}.json",
                                                anchor=m.anchor, sha256="-", published_at=m.published_at))


async def setup_topics(config: FleetConfig) -> None:
    await ensure_topics(config, REGION)


async def send_prompts(config: FleetConfig, n: int, min_version: int) -> list[str]:
    """n prompts of the reverse task; returns their group ids."""
    records = reverse_prompts(config, REGION, n, n_samples=2, max_new_tokens=8, min_version=min_version, seed=3)
    await produce_prompts(config, REGION, records)
    return [r.group_id for r in records]


async def read_partials(config: FleetConfig, n: int, timeout_s: float) -> list[PartialRecord]:
    """Read up to n `partials` records with a fresh consumer group (bounded wait: `timeout_s` is the
    reference machine's figure, scaled in `read_stream`)."""
    got = await read_stream(config, REGION, "partials", n, timeout_s, group=f"{config.run}-test-partials")
    return [d.record for d in got if isinstance(d.record, PartialRecord)]


async def wait_for_beat(cp: ControlPlane, node: str, pred: Callable[[Heartbeat], bool], timeout_s: float) -> Heartbeat:
    """The node's retained heartbeat once `pred` holds (bounded: `timeout_s` is the reference machine's
    figure, scaled by the machine's slowdown)."""
    timeout_s = scaled(timeout_s)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        beat = cp.nodes.get((REGION, node))
        if beat is not None and pred(beat):
            return beat
        await asyncio.sleep(0.05)
    raise AssertionError(f"heartbeat of {REGION}/{node} never matched within {timeout_s} s; last: "
                         f"{cp.nodes.get((REGION, node))}")


def start_agent(data: dict[str, Any], tmp_path: pathlib.Path, node: str, *extra: str) -> tuple[Any, pathlib.Path]:
    """`fleetrl agent` as a process on a config file made from `data`; returns (Popen, its log path)."""
    import json
    import os
    import subprocess
    import sys

    config_path = tmp_path / f"fleet-{node}.yaml"
    config_path.write_text(json.dumps(data))
    env = {**os.environ, "FLEETRL_HUB_KEY": HUB_KEY, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    log_path = tmp_path / f"agent-{node}.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen([sys.executable, "-m", "fleetrl.cli", "agent", "--config", str(config_path),
                                 "--region", REGION, "--node", node, "--log-json", *extra],
                                stdout=log, stderr=subprocess.STDOUT, env=env)
    return proc, log_path


def engines_of(beat: Heartbeat) -> list[Any]:
    assert isinstance(beat.engines, list), beat
    return beat.engines


def metrics_port_from_log(log_path: pathlib.Path, timeout_s: float = 30.0) -> int:
    """The port an agent process serves /metrics and /healthz on (it logs `agent.metrics`; within
    `timeout_s`, scaled)."""
    import json

    deadline = time.monotonic() + scaled(timeout_s)
    while time.monotonic() < deadline:
        for line in log_path.read_text().splitlines():
            if '"agent.metrics"' in line:
                return int(json.loads(line)["port"])
        time.sleep(0.1)
    raise AssertionError(f"no agent.metrics event in {log_path}:\n{log_path.read_text()[-2000:]}")
