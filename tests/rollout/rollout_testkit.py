"""Helpers of the rollout integration tests: a one-region fleet on the tansu fixture and a directory hub."""

from __future__ import annotations

import asyncio
import itertools
import pathlib
from typing import Any

import torch
import yaml

from fleetrl.broker import (
    Consumer,
    Delivery,
    GroupRecord,
    PartialRecord,
    Producer,
    PromptRecord,
    RecordLimits,
    Sampling,
    ensure_topics,
    trainer_group,
)
from fleetrl.config import FleetConfig, parse_config
from fleetrl.hub import Hub
from fleetrl.rollout import get_task

HUB_KEY = "rollout-test-hub-key-0123456789"
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
        "rollout": {"weight_poll_s": 0.2, "idle_poll_s": 0.1, "handover_timeout_s": 15.0,
                    "min_version_wait_s": 60.0, "stats_interval_s": 0.05, **rollout},
        "regions": [{"name": REGION, "kafka": bootstrap, "store": store.as_uri(),
                     "engine": {"kind": "torch", "max_batch": 16}}],
    }


def make_config(data: dict[str, Any]) -> FleetConfig:
    return parse_config(yaml.safe_dump(data), source="rollout-test.yaml", env={})


def publish_tiny(config: FleetConfig, seed: int = 0) -> int:
    """Publish the config's tiny model (weights from `seed`) as the next version, bf16."""
    model_cfg = config.model.model_copy(deep=True)
    model_cfg.tiny.seed = seed
    state = {k: v.to(torch.bfloat16) for k, v in model_cfg.build().state_dict().items()}
    with Hub.from_config(config) as hub:
        return hub.publish(state).version


async def setup_topics(config: FleetConfig) -> None:
    await ensure_topics(config, REGION)


def prompts(config: FleetConfig, n: int, max_new_tokens: int, min_version: int = 0) -> list[PromptRecord]:
    task = get_task("reverse")
    return [
        PromptRecord(group_id=f"{config.run}-g{i}", run=config.run, task="reverse", n_samples=4,
                     sampling=Sampling(temperature=1.0, top_p=1.0, max_new_tokens=max_new_tokens),
                     prompt=p.prompt, reference=p.reference, min_version=min_version)
        for i, p in enumerate(itertools.islice(task.prompts(7), n))
    ]


async def send_prompts(config: FleetConfig, records: list[PromptRecord]) -> None:
    async with Producer(config, REGION, "test-dispatcher") as producer:
        for r in records:
            await producer.send("prompts", r.group_id, r)


async def read_stream(config: FleetConfig, stream: str, n: int, timeout_s: float,
                      group: str | None = None) -> list[Delivery]:
    """Read `n` records of a stream with a fresh consumer group (bounded wait); commits them."""
    limits = RecordLimits.from_config(config)
    async with Producer(config, REGION, "test-reader-dl") as dl, Consumer(
        config, REGION, [stream], group or f"{trainer_group(config.run)}-{stream}", limits, dl, "test-reader",  # type: ignore[list-item]
    ) as consumer:
        got: list[Delivery] = []
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while len(got) < n and loop.time() < deadline:
            got += await consumer.poll(max_records=100, timeout_s=0.3)
        # A little longer: anything beyond n would be a duplicate the test must see.
        got += await consumer.poll(max_records=100, timeout_s=0.5)
        return got


def groups(deliveries: list[Delivery]) -> list[GroupRecord]:
    return [d.record for d in deliveries if isinstance(d.record, GroupRecord)]


def partials(deliveries: list[Delivery]) -> list[PartialRecord]:
    return [d.record for d in deliveries if isinstance(d.record, PartialRecord)]
