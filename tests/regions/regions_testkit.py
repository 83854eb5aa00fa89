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

from fleetrl.broker import ControlPlane, Heartbeat, PartialRecord, ensure_topics
from fleetrl.config import FleetConfig, parse_config

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
        "rollout": {"weight_poll_s": 0.2, "idle_poll_s": 0.1, "handover_timeout_s": 10.0,
                    "min_version_wait_s": 60.0},
        "regions": [{"name": REGION, "kafka": bootstrap, "store": store.as_uri(),
                     "engine": {"kind": "torch", "max_batch": 8}}],
    }


def make_config(data: dict[str, Any]) -> FleetConfig:
    return parse_config(yaml.safe_dump(data), source="regions-test.yaml", env={})


async def setup_topics(config: FleetConfig) -> None:
    await ensure_topics(config, REGION)


async def send_prompts(config: FleetConfig, n: int, min_version: int) -> list[str]:
    """n prompts of the reverse task; returns their group ids."""
    records = reverse_prompts(config, REGION, n, n_samples=2, max_new_tokens=8, min_version=min_version, seed=3)
    await produce_prompts(config, REGION, records)
    return [r.group_id for r in records]


async def read_partials(config: FleetConfig, n: int, timeout_s: float) -> list[PartialRecord]:
    """Read up to n `partials` records with a fresh consumer group (bounded wait)."""
    got = await read_stream(config, REGION, "partials", n, timeout_s, group=f"{config.run}-test-partials")
    return [d.record for d in got if isinstance(d.record, PartialRecord)]


async def wait_for_beat(cp: ControlPlane, node: str, pred: Callable[[Heartbeat], bool], timeout_s: float) -> Heartbeat:
    """The node's retained heartbeat once `pred` holds (bounded)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        beat = cp.nodes.get((REGION, node))
        if beat is not None and pred(beat):
            return beat
        await asyncio.sleep(0.05)
    raise AssertionError(f"heartbeat of {REGION}/{node} never matched within {timeout_s} s; last: "
                         f"{cp.nodes.get((REGION, node))}")
