"""A one-region fleet for the eval tests on the suite's tansu and MQTT, with a directory hub (the region's
store is the home store: no replicator needed)."""

from __future__ import annotations

import pathlib
from typing import Any

import yaml

from fleetrl.config import FleetConfig, parse_config

HUB_KEY = "6680e5459cd0040518f9d6b4ec6f916984f5a12f538b6eea69e195dc1a06cc09"  # Ed25519 private key (hex)
REGION = "r1"


def fleet_dict(run_id: str, bootstrap: str, store: pathlib.Path, mqtt_port: int,
               sets: list[dict[str, Any]]) -> dict[str, Any]:
    return {
        "run": run_id,
        "algorithm": {"n_samples": 2, "max_new_tokens": 8},
        "dataset": {"task": "reverse"},
        "hub": {"home_store": store.as_uri(), "threads": 2, "poll_interval_s": 0.1},
        "kafka": {"partitions": {"prompts": 2, "partials": 2, "trajectories": 2, "dead_letter": 1},
                  "max_message_bytes": 1024 * 1024, "request_timeout_s": 30.0, "retries": 2},
        "mqtt": {"url": f"mqtt://127.0.0.1:{mqtt_port}", "heartbeat_interval_s": 1.0},
        "rollout": {"weight_fallback_poll_s": 0.2, "idle_poll_s": 0.1, "handover_timeout_s": 15.0,
                    "min_version_wait_s": 60.0, "stats_interval_s": 0.05},
        "eval": {"sets": sets},
        "regions": [{"name": REGION, "kafka": bootstrap, "store": store.as_uri(),
                     "engine": {"kind": "torch", "max_batch": 16}}],
    }


def make_config(data: dict[str, Any]) -> FleetConfig:
    return parse_config(yaml.safe_dump(data), source="eval-test.yaml", env={})


def write(tmp_path: pathlib.Path, data: dict[str, Any]) -> pathlib.Path:
    path = tmp_path / "fleet.yaml"
    path.write_text(yaml.safe_dump(data))
    return path
