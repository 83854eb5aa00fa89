"""Helpers of the rollout integration tests: a one-region fleet on the tansu fixture and a directory hub."""

from __future__ import annotations

import pathlib
from typing import Any

import fleet_testkit
import yaml
from fleet_testkit import produce_prompts, reverse_prompts
from fleet_testkit import publish_tiny as publish_tiny  # re-exported for the tests

from fleetrl.broker import Delivery, GroupRecord, PartialRecord, PromptRecord, Stream, ensure_topics
from fleetrl.config import FleetConfig, parse_config

HUB_KEY = "6680e5459cd0040518f9d6b4ec6f916984f5a12f538b6eea69e195dc1a06cc09"  # Ed25519 private key (hex)
REGION = "r1"


def fleet_dict(run_id: str, bootstrap: str, store: pathlib.Path, max_new_tokens: int = 8,
               **rollout: Any) -> dict[str, Any]:
    """One region whose store is the home store itself (no replicator needed)."""
    return {
        "run": run_id,
        "algorithm": {"n_samples": 4, "max_new_tokens": max_new_tokens},
        "dataset": {"task": "reverse"},
        "hub": {"home_store": store.as_uri(), "threads": 2, "poll_interval_s": 0.1},
        "kafka": {"partitions": {"prompts": 2, "partials": 2, "trajectories": 2, "dead_letter": 1},
                  "max_message_bytes": 1024 * 1024, "request_timeout_s": 30.0, "retries": 2},
        "rollout": {"weight_fallback_poll_s": 0.2, "idle_poll_s": 0.1, "handover_timeout_s": 15.0,
                    "min_version_wait_s": 60.0, "stats_interval_s": 0.05, **rollout},
        "regions": [{"name": REGION, "kafka": bootstrap, "store": store.as_uri(),
                     "engine": {"kind": "torch", "max_batch": 16}}],
    }


def make_config(data: dict[str, Any]) -> FleetConfig:
    return parse_config(yaml.safe_dump(data), source="rollout-test.yaml", env={})


async def setup_topics(config: FleetConfig) -> None:
    await ensure_topics(config, REGION)


def prompts(config: FleetConfig, n: int, max_new_tokens: int, min_version: int = 0) -> list[PromptRecord]:
    return reverse_prompts(config, REGION, n, n_samples=4, max_new_tokens=max_new_tokens, min_version=min_version,
                           seed=7)


async def send_prompts(config: FleetConfig, records: list[PromptRecord]) -> None:
    await produce_prompts(config, REGION, records)


async def read_stream(config: FleetConfig, stream: Stream, n: int, timeout_s: float,
                      group: str | None = None, *, scale: bool = True) -> list[Delivery]:
    """Read `n` records of a stream with a fresh consumer group (bounded wait; `timeout_s` is the
    reference machine's figure, scaled unless `scale=False`: see `fleet_testkit.read_stream`)."""
    return await fleet_testkit.read_stream(config, REGION, stream, n, timeout_s, group, scale=scale)


def groups(deliveries: list[Delivery]) -> list[GroupRecord]:
    return [d.record for d in deliveries if isinstance(d.record, GroupRecord)]


def partials(deliveries: list[Delivery]) -> list[PartialRecord]:
    return [d.record for d in deliveries if isinstance(d.record, PartialRecord)]
