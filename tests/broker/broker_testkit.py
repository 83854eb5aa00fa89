"""Helpers of the broker tests: a fleet config pointing at the fixture servers, records to send."""

from __future__ import annotations

import asyncio
import pathlib
from collections.abc import Callable
from typing import Any

import numpy as np
import yaml
from slowdown import scaled

from fleetrl.broker import ControlCommand, GroupRecord, PromptRecord, Sample, Sampling, floats, ids
from fleetrl.config import FleetConfig, parse_config

VOCAB = 128


def fleet_yaml(run_id: str, bootstrap: str, mqtt_port: int = 1883, partitions: int = 4, **extra: Any) -> dict[str, Any]:
    """A small fleet.yaml (as a dict) with one region `r1` on `bootstrap`."""
    data: dict[str, Any] = {
        "run": run_id,
        "model": {"tiny": {"vocab_size": VOCAB}},
        "algorithm": {"n_samples": 4, "max_new_tokens": 16},
        "dataset": {"task": "reverse"},
        "mqtt": {"url": f"mqtt://127.0.0.1:{mqtt_port}", "reconnect_max_s": 1.0},
        "kafka": {
            "partitions": {"prompts": partitions, "partials": partitions, "trajectories": partitions,
                           "dead_letter": 1},
            "max_message_bytes": 1024 * 1024,
            "request_timeout_s": 10.0,
            "retries": 2,
        },
        "regions": [{"name": "r1", "kafka": bootstrap, "store": "/tmp/fleetrl-test-store"}],
    }
    for key, value in extra.items():
        data[key] = {**data.get(key, {}), **value} if isinstance(value, dict) else value
    return data


def make_config(data: dict[str, Any]) -> FleetConfig:
    return parse_config(yaml.safe_dump(data), source="test-fleet.yaml", env={})


def write_config(data: dict[str, Any], path: pathlib.Path) -> pathlib.Path:
    path.write_text(yaml.safe_dump(data))
    return path


def make_group(group_id: str, run: str = "run", n_samples: int = 2, n_tokens: int = 5, **over: Any) -> GroupRecord:
    """A valid finished group unless `over` says otherwise (task, token ids, logprobs)."""
    rng = np.random.default_rng(abs(hash(group_id)) % 2**32)
    samples = []
    for _ in range(n_samples):
        tokens = over.get("tokens", rng.integers(0, VOCAB, n_tokens))
        logprobs = over.get("logprobs", -rng.random(len(tokens)))
        samples.append(Sample(ids(tokens), floats(logprobs), ids(np.zeros(len(tokens))), reward=1.0,
                              finish_reason="stop"))
    return GroupRecord(group_id=group_id, run=run, task=over.get("task", "reverse"), attempt=0, region="r1",
                       node="n1", prompt_ids=ids([1, 2, 3]), samples=samples)


def make_prompt(group_id: str, run: str = "run", task: str = "reverse") -> PromptRecord:
    return PromptRecord(group_id=group_id, run=run, task=task, n_samples=2, sampling=Sampling(max_new_tokens=8),
                        prompt=f"reverse {group_id}")


async def poll_until(consumer: Any, n: int, timeout_s: float = 30.0, max_records: int = 100) -> list[Any]:
    """Poll until `n` deliveries arrived (or the deadline passed); returns what arrived. `timeout_s`, as
    every bound of these helpers, is the reference machine's figure, scaled by the machine's slowdown."""
    got: list[Any] = []
    loop = asyncio.get_running_loop()
    deadline = loop.time() + scaled(timeout_s)
    while len(got) < n and loop.time() < deadline:
        got += await consumer.poll(max_records=max_records, timeout_s=0.5)
    return got


async def wait_for(predicate: Callable[[], Any], timeout_s: float, step_s: float = 0.05) -> bool:
    """Whether `predicate()` holds within `timeout_s` (scaled), checked every `step_s`."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + scaled(timeout_s)
    while loop.time() < deadline:
        if predicate():
            return True
        await asyncio.sleep(step_s)
    return bool(predicate())


PROBE = "probe: the subscription is in place"
"""The reason of the commands `commands_listening` sends until one arrives (`next_command` skips them)."""


async def commands_listening(commands: Any, operator: Any, region: str, timeout_s: float = 30.0) -> None:
    """Return once `commands` (a `ControlPlane.commands(region)` iterator) hears commands: `operator`
    sends probes until one arrives. Commands are not retained, so one sent before the subscription is in
    place is lost; waiting for a probe instead of a fixed sleep keeps that from deciding a test."""
    pending = asyncio.ensure_future(anext(commands))
    try:
        async with asyncio.timeout(scaled(timeout_s)):
            while True:
                await operator.send_control(region, ControlCommand(cmd="resume", reason=PROBE))
                done, _ = await asyncio.wait({pending}, timeout=0.5)
                if done:
                    assert pending.result().reason == PROBE, pending.result()
                    return
    finally:
        pending.cancel()


async def next_command(commands: Any, timeout_s: float = 10.0) -> Any:
    """The next command that is not a probe of `commands_listening` (a late one may still arrive)."""
    async with asyncio.timeout(scaled(timeout_s)):
        async for command in commands:
            if command.reason != PROBE:
                return command
    raise AssertionError("the command stream ended")
