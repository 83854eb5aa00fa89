"""Cross-region handover end to end: region `a` drained mid-generation, its partials finished in `b`.

Real components: two tansu brokers (one Kafka cluster per region), an MQTT broker, a directory hub,
the trainer (`Trainer` with its learner) and one rollout worker per region (`RolloutWorker`, torch
engine on the tiny model). Each node's heartbeat is published on the control plane the way its
region agent publishes it (`up`, then `draining` when drained). Region `a`'s engine is slowed
(`engine.emulate`) so that it holds groups mid-generation when drained.

What must hold: the trainer moves `a`'s partials to `b` with `attempt + 1`; `b` resumes them, keeping
every token `a` generated (0 regenerated: the tokens sampled by both engines are exactly the tokens
of the groups that reach `trajectories`), and the audit balances.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import pathlib
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from slowdown import scaled

from fleetrl import devstack
from fleetrl.broker import ControlPlane, EngineStatus, GroupRecord, Heartbeat, ensure_topics
from fleetrl.config import FleetConfig
from fleetrl.rollout.worker import RolloutWorker
from fleetrl.trainer.audit import read_topics, reconcile
from fleetrl.trainer.checkpoint import latest
from fleetrl.trainer.dist import DistContext
from fleetrl.trainer.learner import Learner
from fleetrl.trainer.service import Trainer

pytestmark = [pytest.mark.e2e, pytest.mark.integration]
HUB_KEY = "6680e5459cd0040518f9d6b4ec6f916984f5a12f538b6eea69e195dc1a06cc09"
MAX_NEW_TOKENS = 24
GROUPS = 4


@pytest.fixture(autouse=True)
def _env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FLEETRL_HUB_KEY", HUB_KEY)
    torch.set_num_threads(1)


@pytest.fixture
def clusters() -> Iterator[dict[str, devstack.ServerProcess]]:
    """One tansu broker per region; stopped by this fixture."""
    with devstack.tansu() as a, devstack.tansu() as b:
        yield {"a": a, "b": b}


def fleet(run_id: str, tmp: pathlib.Path, clusters: dict[str, devstack.ServerProcess], mqtt_port: int, *,
          handover_timeout_s: float = 8.0, max_groups_in_flight: int = 4, a_step_delay_s: float = 0.15) -> FleetConfig:
    store = (tmp / "hub").as_uri()  # every region reads the home store: no replicator needed here

    def region(name: str, step_delay_s: float) -> dict[str, Any]:
        # tail_p 1: every sample runs to max_new_tokens (a handed-over sample keeps its length in `b`)
        return {"name": name, "kafka": f"127.0.0.1:{clusters[name].port}", "store": store, "nodes": [{"name": "n1"}],
                "engine": {"kind": "torch", "max_batch": 16,
                           "emulate": {"step_delay_s": step_delay_s, "tail_p": 1.0}}}

    return FleetConfig.model_validate({
        "run": run_id,
        "model": {"tiny": {"vocab_size": 128, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2}},
        "algorithm": {"groups_per_step": 2, "n_samples": 2, "max_staleness": 1, "max_new_tokens": MAX_NEW_TOKENS,
                      "lr": 1e-3},
        "dataset": {"task": "reverse", "num_prompts": GROUPS},
        "hub": {"home_store": store, "threads": 1, "poll_interval_s": 0.1},
        "mqtt": {"url": f"mqtt://127.0.0.1:{mqtt_port}", "heartbeat_interval_s": 0.5},
        "kafka": {"partitions": {"prompts": 1, "partials": 1, "trajectories": 1, "dead_letter": 1},
                  "max_message_bytes": 1024 * 1024, "request_timeout_s": 15.0},
        "rollout": {"weight_fallback_poll_s": 0.2, "idle_poll_s": 0.05, "handover_timeout_s": handover_timeout_s,
                    "min_version_wait_s": 60.0, "stats_interval_s": 60.0,
                    "max_groups_in_flight": max_groups_in_flight},
        "trainer": {"checkpoint_dir": str(tmp / "ckpt"), "checkpoint_every": 1},
        "regions": [region("a", a_step_delay_s), region("b", 0.0)],
    })


def reverse_prompts() -> Iterator[tuple[str, str, str]]:
    return itertools.cycle([("reverse", "abc=", "cba"), ("reverse", "dab=", "bad"), ("reverse", "cdb=", "bdc")])


class Node:
    """A region's node: one in-process rollout worker plus the heartbeat its agent would publish.

    `engine`: the engine state the heartbeat reports (None: no engine statuses, which serves while
    `up`); with `start=False` the node beats (an agent whose engine loads) and runs no worker until
    `start()`."""

    def __init__(self, config: FleetConfig, region: str, *, start: bool = True, engine: str | None = None) -> None:
        self.config, self.region = config, region
        self.worker = RolloutWorker(config, region, "n1")
        self.stop = asyncio.Event()
        self.state, self.engine = "up", engine
        self.task: asyncio.Task[None] | None = None
        if start:
            self.start()
        self.beats = asyncio.create_task(self._beat(), name=f"heartbeat-{region}")

    def start(self) -> None:
        self.task = asyncio.create_task(self.worker.run(self.stop), name=f"worker-{self.region}")

    async def _beat(self) -> None:
        async with ControlPlane(self.config, f"{self.config.run}-agent-{self.region}", watch_nodes=False) as cp:
            while True:
                engines = [EngineStatus(index=0, state=self.engine)] if self.engine is not None else 0
                beat = Heartbeat(state=self.state, tokens_per_s=50.0, in_flight=len(self.worker._jobs),
                                 engines=engines, left=self.state == "offline")
                await cp.heartbeat(self.region, "n1", beat)
                await asyncio.sleep(self.config.mqtt.heartbeat_interval_s)

    async def drain(self) -> None:
        """What `fleetrl control drain` does to the node: `draining`, then every unfinished group handed over."""
        self.state = "draining"
        self.worker.stop_reason = "drain"
        self.stop.set()
        assert self.task is not None
        await asyncio.wait_for(self.task, scaled(30))

    async def close(self) -> None:
        self.stop.set()
        self.beats.cancel()
        for task in (self.task, self.beats):
            if task is not None:
                with contextlib.suppress(asyncio.CancelledError):
                    await asyncio.wait_for(task, scaled(30))


async def test_a_drained_region_s_partials_are_finished_in_another_region_keeping_every_token(
        run_id: str, tmp_path: pathlib.Path, clusters: dict[str, devstack.ServerProcess],
        mqtt_server: devstack.ServerProcess) -> None:
    config = fleet(run_id, tmp_path, clusters, mqtt_server.port)
    for region in ("a", "b"):
        await ensure_topics(config, region)
    trainer = Trainer(config, reverse_prompts, Learner(config.model, config.algorithm, DistContext()))
    a = Node(config, "a")
    train = asyncio.create_task(trainer.run(max_steps=GROUPS // 2))
    b: Node | None = None
    try:
        # a holds groups mid-generation (b has not started: everything dispatched waits for a or b)
        async with asyncio.timeout(scaled(90)):
            while a.worker.engine.tokens_sampled < 2 * 2 * 4 or not a.worker._jobs:
                await asyncio.sleep(0.05)
        await a.drain()
        handed = a.worker.groups_handed_over
        assert handed >= 1
        b = Node(config, "b")
        result = await asyncio.wait_for(train, scaled(180))
    finally:
        await _stop(train, a, b)
    assert result.steps == GROUPS // 2 and result.trained_groups == GROUPS
    assert trainer.handover.partials_moved == handed  # every partial a handed over, moved once
    m = trainer.metrics.registry
    assert m.get_sample_value("fleetrl_trainer_partials_moved_total") == handed

    # 0 regenerated: every token sampled by either engine is in exactly one trained group
    view = await read_topics(config)
    groups = [g for g in await _trajectories(config) if isinstance(g, GroupRecord)]
    trained = {e.group_id: e.attempt for e in trainer.collector.trained}
    kept = {g.group_id: g for g in groups if trained.get(g.group_id) == g.attempt}
    assert set(kept) == set(trained)
    tokens_trained = sum(len(s.completion_ids) for g in kept.values() for s in g.samples)
    sampled = a.worker.engine.tokens_sampled + b.worker.engine.tokens_sampled
    assert sampled - tokens_trained == 0
    moved = [g for g in kept.values() if g.region == "b" and g.attempt == 1]
    assert len(moved) == handed  # finished in b as the next attempt

    ckpt = latest(config.trainer.checkpoint_dir, config.run)
    assert ckpt is not None
    report = reconcile(view, ckpt.state, config.run)
    assert report.ok, report.problems()
    assert report.trained == GROUPS


async def test_groups_a_preempted_region_never_started_move_once_its_nodes_are_offline_and_partials_read(
        run_id: str, tmp_path: pathlib.Path, clusters: dict[str, devstack.ServerProcess],
        mqtt_server: devstack.ServerProcess) -> None:
    """An agent that leaves says `offline` with `left` only after its workers handed over. Groups still
    unread in its region's
    `prompts` have no partial coming, so they move as prompts once the trainer has read the region's
    partials to their end: not after the handover bound, 600 s here (the test's own bound is 180 s; both are
    scaled by the machine's slowdown, so that the test's bound stays the shorter one)."""
    # a's groups take 12 s each (24 steps of 0.5 s): the trainer's handover consumer joins its group while a
    # still holds more than 2 of them, however long the join takes on busy cores (the drain comes once it has).
    config = fleet(run_id, tmp_path, clusters, mqtt_server.port, handover_timeout_s=scaled(600.0),
                   max_groups_in_flight=1, a_step_delay_s=0.5)
    for region in ("a", "b"):
        await ensure_topics(config, region)
    trainer = Trainer(config, reverse_prompts, Learner(config.model, config.algorithm, DistContext()))
    b = Node(config, "b", start=False, engine="starting")  # b's engine loads: it takes no work yet
    a = Node(config, "a")
    train = asyncio.create_task(trainer.run(max_steps=GROUPS // 2))
    try:
        # a's worker takes 2 groups (1 decoding, 1 waiting); the rest of what a holds stays in its topic.
        # The handover consumers joined their groups at start, while a lives (a join takes seconds).
        async with asyncio.timeout(scaled(90)):
            while not a.worker.engine.tokens_sampled or sum(
                    f.region == "a" for f in trainer.dispatcher.in_flight.values()) <= 2 \
                    or not trainer.handover.ready("a"):
                await asyncio.sleep(0.05)
        assert "a" not in trainer.handover.watch.gone
        await a.drain()
        a.state = "offline"  # the agent leaves (`left`), once its workers have handed over
        handed = a.worker.groups_handed_over
        assert handed >= 1
        b.start()
        b.engine = "up"
        result = await asyncio.wait_for(train, scaled(180))
    finally:
        await _stop(train, a, b)
    assert result.steps == GROUPS // 2 and result.trained_groups == GROUPS
    assert trainer.handover.partials_moved == handed
    assert trainer.handover.prompts_moved >= 1  # the unread ones, long before the handover bound
    assert not any(f.region == "a" for f in trainer.dispatcher.in_flight.values())
    ckpt = latest(config.trainer.checkpoint_dir, config.run)
    assert ckpt is not None
    report = reconcile(await read_topics(config), ckpt.state, config.run)
    assert report.ok, report.problems()


async def _stop(train: asyncio.Task[Any], *nodes: Node | None) -> None:
    """Cancel the trainer if it still runs, then close the nodes that were started."""
    if not train.done():
        train.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await train
    for node in nodes:
        if node is not None:
            await node.close()


async def _trajectories(config: FleetConfig) -> list[Any]:
    from fleetrl.broker import decode_record, read_log, topic_name

    out = []
    for region in ("a", "b"):
        for raw in await read_log(config, region, topic_name(config.run, "trajectories"), client_id="test-read"):
            out.append(decode_record(raw.value))
    return out
