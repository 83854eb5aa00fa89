"""Tokens regenerated after preempting a rollout worker mid-group: token-level handover vs restart.

Real components: a tansu broker (`fleetrl.devstack`), a directory hub holding version 0 of the
tiny Qwen2, and two in-process rollout workers of one region. Worker A takes G groups (n samples,
long completions: a random-init model rarely emits EOS) and is preempted once it holds
`--preempt-tokens` generated tokens:

* handover: A's preemption notice fires; it publishes every unfinished group to `partials` with
  the tokens so far, commits, and stops. Worker B resumes the samples where they stopped.
* baseline (restart the group): A is killed (its task cancelled: no handover, no commit); worker
  B receives the same prompts again and generates every group from scratch.

Each engine counts the tokens it sampled; regenerated tokens are everything sampled by A and B
beyond the tokens of the finished groups that reach `trajectories`.

    .venv/bin/python bench/handover.py [--quick]

Last line: `result: regenerated_tokens=... baseline_regenerated_tokens=... preempted_tokens=...`
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import pathlib
import tempfile
import time
import uuid
from typing import Any

import torch

from fleetrl import devstack
from fleetrl.broker import Consumer, GroupRecord, Producer, PromptRecord, RecordLimits, Sampling, ensure_topics
from fleetrl.config import FleetConfig
from fleetrl.hub import Hub
from fleetrl.hub.signing import generate_ed25519
from fleetrl.rollout.worker import RolloutWorker

REGION = "bench"


def make_config(bootstrap: str, store: pathlib.Path, max_new_tokens: int) -> FleetConfig:
    return FleetConfig.model_validate({
        "run": f"bench-{uuid.uuid4().hex[:8]}",
        "algorithm": {"n_samples": 4, "max_new_tokens": max_new_tokens},
        "hub": {"home_store": store.as_uri(), "threads": 2},
        "kafka": {"partitions": {"prompts": 2, "partials": 2, "trajectories": 2, "dead_letter": 1},
                  "max_message_bytes": 1024 * 1024, "request_timeout_s": 30.0},
        "rollout": {"weight_fallback_poll_s": 0.5, "idle_poll_s": 0.1, "stats_interval_s": 60.0},
        "regions": [{"name": REGION, "kafka": bootstrap, "store": store.as_uri()}],
    })


async def prepare(config: FleetConfig, groups: int, max_new_tokens: int) -> None:
    state = {k: v.to(torch.bfloat16) for k, v in config.model.build().state_dict().items()}
    with Hub.from_config(config) as hub:
        hub.publish(state)
    await ensure_topics(config, REGION)
    async with Producer(config, REGION, "bench-dispatcher") as producer:
        for i in range(groups):
            prompt = PromptRecord(group_id=f"{config.run}-g{i}", run=config.run, task="reverse", n_samples=4,
                                  sampling=Sampling(max_new_tokens=max_new_tokens), prompt=f"abc{i}=",
                                  reference="cba")
            await producer.send("prompts", prompt.group_id, prompt)


async def worker_until(config: FleetConfig, node: str, done: Any, timeout_s: float,
                       crash: bool = False) -> RolloutWorker:
    """Run a worker until `done(worker)`; then preempt it (handover), or cancel it (`crash`)."""
    worker, stop, preempted = RolloutWorker(config, REGION, node), asyncio.Event(), asyncio.Event()
    task = asyncio.create_task(worker.run(stop, preempted))
    deadline = time.monotonic() + timeout_s
    while not done(worker) and time.monotonic() < deadline and not task.done():
        await asyncio.sleep(0.01)
    if crash:
        task.cancel()
    else:
        preempted.set()
    with contextlib.suppress(asyncio.CancelledError):
        await asyncio.wait_for(task, timeout=60)
    return worker


async def final_tokens(config: FleetConfig, groups: int) -> int:
    limits = RecordLimits.from_config(config)
    async with Producer(config, REGION, "bench-dl") as dl, Consumer(
        config, REGION, ["trajectories"], f"{config.run}-reader", limits, dl, "bench-reader"
    ) as consumer:
        seen: dict[str, GroupRecord] = {}
        deadline = time.monotonic() + 60
        while len(seen) < groups and time.monotonic() < deadline:
            for d in await consumer.poll(100, 0.5):
                if isinstance(d.record, GroupRecord):
                    seen[d.record.group_id] = d.record
    if len(seen) < groups:
        raise SystemExit(f"only {len(seen)} of {groups} groups reached trajectories")
    return sum(len(s.completion_ids) for g in seen.values() for s in g.samples)


async def measure(bootstrap: str, crash: bool, args: argparse.Namespace) -> tuple[int, int]:
    """Returns (regenerated tokens, tokens worker A had generated when preempted)."""
    with tempfile.TemporaryDirectory() as tmp:
        config = make_config(bootstrap, pathlib.Path(tmp) / "store", args.max_new_tokens)
        await prepare(config, args.groups, args.max_new_tokens)
        a = await worker_until(config, "a", lambda w: w.stats()["tokens_in_flight"] >= args.preempt_tokens,
                               timeout_s=120, crash=crash)
        b = await worker_until(config, "b", lambda w: w.groups_done >= args.groups, timeout_s=300)
        final = await final_tokens(config, args.groups)
        sampled = a.engine.tokens_sampled + b.engine.tokens_sampled
        mode = "restart" if crash else "handover"
        print(f"{mode:8s}: A sampled {a.engine.tokens_sampled}, B sampled {b.engine.tokens_sampled}, "
              f"finished groups hold {final} tokens -> regenerated {sampled - final}")
        return sampled - final, a.engine.tokens_sampled


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer groups (under two minutes on 2 cores)")
    args = parser.parse_args()
    args.groups = 2 if args.quick else 6
    args.max_new_tokens = 160 if args.quick else 320
    args.preempt_tokens = 200 if args.quick else 1000
    torch.set_num_threads(1)
    os.environ.setdefault("FLEETRL_HUB_KEY", generate_ed25519()[0])  # this run's signing key (Ed25519, the default)
    with devstack.tansu() as server:
        bootstrap = f"127.0.0.1:{server.port}"
        regenerated, preempted = asyncio.run(measure(bootstrap, crash=False, args=args))
        baseline, _ = asyncio.run(measure(bootstrap, crash=True, args=args))
    print(f"result: regenerated_tokens={regenerated} baseline_regenerated_tokens={baseline} "
          f"preempted_tokens={preempted}")


if __name__ == "__main__":
    main()
