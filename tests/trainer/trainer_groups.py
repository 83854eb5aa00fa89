"""Synthetic finished groups for trainer tests (a stand-in rollout that needs no engine)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import numpy as np

from fleetrl.broker import GroupRecord, Sample, floats, ids

HUB_KEY = "521fe9e362612bb16b959e190a5079326a4a26fe4e1b751b2ed22b8d0a5c94c8"
"""Ed25519 private key (hex) of the trainer tests' hub (FLEETRL_HUB_KEY of in-process and child processes)."""


def make_group(gid: str, run: str, *, version: int = 0, n: int = 4, seed: int = 0, task: str = "reverse",
               attempt: int = 0, region: str = "local-a", vocab: int = 128, length: int = 5,
               rewards: list[float] | None = None) -> GroupRecord:
    """A group whose samples are random tokens with plausible behaviour logprobs."""
    rng = np.random.default_rng(seed)
    samples = []
    for i in range(n):
        L = int(rng.integers(1, length + 1))
        samples.append(Sample(
            completion_ids=ids(rng.integers(3, vocab, L)),
            logprobs=floats(-rng.uniform(0.5, 6.0, L)),
            versions=np.full(L, version, dtype=np.int32),
            reward=float(rewards[i]) if rewards is not None else float(rng.uniform(0, 1)),
            finish_reason="stop",
        ))
    return GroupRecord(group_id=gid, run=run, task=task, attempt=attempt, region=region, node="node-1",
                       prompt_ids=ids(rng.integers(3, vocab, 4)), samples=samples)


async def answer_prompts(config: Any, region: str, done: Callable[[], bool], answered: list[str],
                         pace: Callable[[int], Awaitable[None]] | None = None,
                         newest: Callable[[], int] | None = None) -> None:
    """A stand-in rollout region: answers every prompt with a synthetic group at its min_version;
    `pace(i)`, where given, is awaited before the i-th answer (0-based). With `newest` (the newest
    version published), a prompt sent ahead waits until its min_version is, as a worker waits."""
    from fleetrl.broker import Consumer, Delivery, Producer, PromptRecord, RecordLimits, rollout_group

    limits = RecordLimits.from_config(config)
    held: list[Delivery] = []
    async with Producer(config, region, "stand-in-rollout") as prod, Consumer(
        config, region, ["prompts"], rollout_group(config.run), limits, prod, "stand-in-rollout"
    ) as cons:
        while not done():
            ready: list[Delivery] = []
            waiting: list[Delivery] = []
            for d in held + await cons.poll(16, 0.2):
                (ready if newest is None or d.record.min_version <= newest() else waiting).append(d)
            held = waiting
            for d in ready:
                p = d.record
                assert isinstance(p, PromptRecord)
                if pace is not None:
                    await pace(len(answered))
                g = make_group(p.group_id, p.run, version=p.min_version, n=p.n_samples,
                               seed=int(p.group_id.rsplit("-", 1)[1]), attempt=p.attempt, region=region)
                await prod.send("trajectories", g.group_id, g)
                answered.append(g.group_id)
                await cons.commit([d])
