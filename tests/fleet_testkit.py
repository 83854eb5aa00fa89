"""Helpers shared by tests that drive a one-region fleet: weights to the hub, prompts in, records out.

The rollout and region-agent testkits build their own fleet configs and import these.
"""

from __future__ import annotations

import asyncio
import itertools

import torch
from slowdown import scaled

from fleetrl.broker import Consumer, Delivery, Producer, PromptRecord, RecordLimits, Sampling, Stream, trainer_group
from fleetrl.config import FleetConfig
from fleetrl.hub import Hub
from fleetrl.rollout import get_task


def publish_tiny(config: FleetConfig, seed: int | None = None) -> int:
    """Publish the config's tiny model (weights from `seed`, default the config's) as the next version, bf16."""
    model_cfg = config.model.model_copy(deep=True)
    if seed is not None:
        model_cfg.tiny.seed = seed
    state = {k: v.to(torch.bfloat16) for k, v in model_cfg.build().state_dict().items()}
    with Hub.from_config(config) as hub:
        return hub.publish(state).version


def reverse_prompts(config: FleetConfig, region: str, n: int, *, n_samples: int, max_new_tokens: int,
                    min_version: int = 0, seed: int = 0) -> list[PromptRecord]:
    """n prompts of the `reverse` task with group ids `<run>-g<i>`."""
    task = get_task("reverse")
    return [
        PromptRecord(group_id=f"{config.run}-g{i}", run=config.run, task="reverse", n_samples=n_samples,
                     sampling=Sampling(temperature=1.0, top_p=1.0, max_new_tokens=max_new_tokens),
                     prompt=p.prompt, reference=p.reference, min_version=min_version)
        for i, p in enumerate(itertools.islice(task.prompts(seed), n))
    ]


async def produce_prompts(config: FleetConfig, region: str, records: list[PromptRecord]) -> None:
    async with Producer(config, region, "test-dispatcher") as producer:
        for r in records:
            await producer.send("prompts", r.group_id, r)


async def read_stream(config: FleetConfig, region: str, stream: Stream, n: int, timeout_s: float,
                      group: str | None = None, distinct: bool = False, *, scale: bool = True) -> list[Delivery]:
    """Read `n` records of a stream with a fresh consumer group (bounded wait), and whatever follows
    within half a second: anything beyond n would be a duplicate the test must see.

    `timeout_s` is a hang bound written for the reference machine and scaled by the machine's slowdown
    (tests/slowdown.py). `scale=False`: it is instead the window of a test that asserts that nothing
    arrives, taken as written.

    `distinct`: `n` records of different keys. A redone group may legitimately arrive twice (at least
    once delivery: a worker killed between its produce and its commit), and counting that duplicate
    toward `n` would stop the read before the last distinct record, which then had only the last half
    second to arrive."""
    limits = RecordLimits.from_config(config)
    async with Producer(config, region, "test-reader-dl") as dl, Consumer(
        config, region, [stream], group or f"{trainer_group(config.run)}-{stream}", limits, dl, "test-reader",
    ) as consumer:
        got: list[Delivery] = []
        loop = asyncio.get_running_loop()
        deadline = loop.time() + (scaled(timeout_s) if scale else timeout_s)
        while len({d.key for d in got} if distinct else got) < n and loop.time() < deadline:
            got += await consumer.poll(max_records=100, timeout_s=0.3)
        got += await consumer.poll(max_records=100, timeout_s=0.5)
        return got
