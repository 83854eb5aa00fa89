"""The trainer against real tansu, amqtt/mosquitto and a directory hub.

A scripted rollout side answers the trainer's prompts with synthetic groups and misbehaves on
purpose: one group delivered twice, one redone as attempt 1 after it was trained, raw garbage on
the trajectories topic, and one group held back until it is too stale.
"""

from __future__ import annotations

import asyncio
import itertools
import threading
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
from slowdown import scaled
from trainer_groups import make_group

from fleetrl.broker import (
    Consumer,
    GroupRecord,
    Producer,
    PromptRecord,
    RecordLimits,
    ensure_topics,
    rollout_group,
    topic_name,
)
from fleetrl.config import FleetConfig
from fleetrl.trainer.audit import read_topics, reconcile
from fleetrl.trainer.batch import StepBatch
from fleetrl.trainer.checkpoint import latest
from fleetrl.trainer.dist import DistContext
from fleetrl.trainer.learner import Learner, StepStats
from fleetrl.trainer.service import Trainer

pytestmark = pytest.mark.integration
REGION = "local-a"
STEPS = 5


def reverse_prompts() -> itertools.cycle[tuple[str, str, str]]:
    return itertools.cycle([("reverse", "abc=", "cba"), ("reverse", "dab=", "bad"), ("reverse", "cc=", "cc")])


class ScriptedRollout:
    """Answers prompts at their min_version, except for the planned mischief."""

    def __init__(self, config: FleetConfig, trainer: Trainer) -> None:
        self.config, self.trainer = config, trainer
        self.answered: list[str] = []
        self.held: PromptRecord | None = None
        self.stale_id: str | None = None
        self.first: GroupRecord | None = None

    def group(self, p: PromptRecord, version: int, attempt: int = 0) -> GroupRecord:
        g = make_group(p.group_id, p.run, version=version, n=p.n_samples, seed=hash(p.group_id) % 1000,
                       attempt=attempt, region=REGION)
        return g

    async def run(self, done: Callable[[], bool]) -> None:
        limits = RecordLimits.from_config(self.config)
        async with Producer(self.config, REGION, "scripted-rollout") as prod, Consumer(
            self.config, REGION, ["prompts"], rollout_group(self.config.run), limits, prod, "scripted-rollout"
        ) as cons:
            await prod.send_raw(topic_name(self.config.run, "trajectories"), b"garbage-key",
                                b"\xc1 this is not msgpack", [])
            while not done():
                for d in await cons.poll(16, 0.2):
                    await self.answer(prod, d.record)
                    await cons.commit([d])
                await self.maybe_release_held(prod)

    async def answer(self, prod: Producer, p: object) -> None:
        assert isinstance(p, PromptRecord)
        if self.held is None:
            self.held = p  # kept back until the learner is 3 versions ahead: then it is stale
            return
        g = self.group(p, p.min_version)
        await prod.send("trajectories", g.group_id, g)
        self.answered.append(g.group_id)
        if self.first is None:
            self.first = g
            await prod.send("trajectories", g.group_id, g)  # delivered twice
        elif len(self.answered) == 6:
            redo = self.group(self.first_prompt_like(), self.trainer.version, attempt=1)
            await prod.send("trajectories", redo.group_id, redo)  # a redone attempt of a trained group

    def first_prompt_like(self) -> PromptRecord:
        assert self.first is not None
        return PromptRecord(group_id=self.first.group_id, run=self.first.run, task="reverse", n_samples=2,
                            sampling=self.trainer.dispatcher.sampling, prompt="x")

    async def maybe_release_held(self, prod: Producer) -> None:
        h = self.held
        if h is None or self.stale_id is not None or self.trainer.version < h.min_version + 3:
            return
        g = self.group(h, h.min_version)  # every token from version min_version: lag 3 > s + 1 = 2
        await prod.send("trajectories", g.group_id, g)
        self.stale_id = g.group_id


async def test_each_valid_group_trained_once_malformed_dead_lettered_stale_counted(
        make_fleet: Callable[..., FleetConfig]) -> None:
    """Also tracking on the real path: TensorBoard and an MLflow server nobody listens on (it costs no
    step, and is disabled once); every step's figures in metrics.jsonl and the event files, once."""
    from fleetrl.devstack import free_port

    config = make_fleet()
    config.tracking.report_to = ["tensorboard", "mlflow"]
    config.tracking.mlflow_tracking_uri = f"http://127.0.0.1:{free_port()}"
    config.tracking.samples_every = 2
    await ensure_topics(config, REGION)
    learner = Learner(config.model, config.algorithm, DistContext())
    trainer = Trainer(config, reverse_prompts, learner)
    rollout = ScriptedRollout(config, trainer)
    stop = asyncio.Event()
    train_task = asyncio.create_task(trainer.run(max_steps=STEPS + 3, stop=stop))
    side = asyncio.create_task(rollout.run(lambda: train_task.done() or (
        rollout.stale_id is not None and trainer.step >= STEPS)))
    await asyncio.wait_for(side, timeout=scaled(120))
    # The last groups answered may still be in the topic: give the trainer (bounded: 30 s on the reference
    # machine, scaled) time to read them.
    c = trainer.collector
    for _ in range(round(scaled(600))):
        if train_task.done() or set(rollout.answered) <= {e.group_id for e in c.trained} | set(c.pending):
            break
        await asyncio.sleep(0.05)
    # The trainer finishes its steps only if enough groups arrive: stop it once the script is through,
    # the way SIGTERM does (finish the step, checkpoint, commit). A cancel could land between a step
    # and its checkpoint, and the audit below must compare with a checkpoint of every trained step.
    stop.set()
    await asyncio.wait_for(train_task, timeout=scaled(60))  # surfaces the trainer's exception, if any
    trained = [e.group_id for e in c.trained]
    assert len(trained) == len(set(trained)) >= 2 * STEPS  # none twice
    assert rollout.stale_id is not None and set(c.stale) == {rollout.stale_id}
    assert set(trained) | set(c.pending) == set(rollout.answered)  # every valid group, exactly once
    assert c.duplicates >= 2  # the second delivery and the redone attempt
    m = trainer.metrics.registry
    assert m.get_sample_value("fleetrl_trainer_stale_groups_dropped_total", {"region": REGION}) == 1.0
    assert (m.get_sample_value("fleetrl_trainer_duplicate_groups_total", {"region": REGION}) or 0) >= 2
    assert (m.get_sample_value("fleetrl_trainer_weight_publish_bytes_total") or 0) > 0
    # the malformed record is in the dead-letter topic with its reason
    view = await read_topics(config)
    assert view.dead.get("garbage-key") == ["malformed"]
    # and the audit agrees with the newest checkpoint
    ckpt = latest(config.trainer.checkpoint_dir, config.run)
    assert ckpt is not None and ckpt.step == trainer.step
    report = reconcile(view, ckpt.state, config.run)
    assert report.ok, report.problems()
    assert report.trained == len(trained) and report.stale == 1
    assert np.isfinite(trainer.result.rewards).all()
    # The cost meter counts the waste where it was paid: the duplicates' and the stale group's tokens.
    regenerated = trainer.cost.tokens_regenerated[REGION]
    assert regenerated >= 3 * 2  # three groups of two samples, each at least a token long
    assert m.get_sample_value("fleetrl_cost_tokens_regenerated_total", {"region": REGION}) == regenerated
    assert ckpt.state["cost"]["regions"][REGION][2] == len(trained)  # groups trained, in the checkpoint
    _check_tracking(config, trainer)


def _check_tracking(config: FleetConfig, trainer: Trainer) -> None:
    """Every step's figures once in metrics.jsonl and in TensorBoard's event files; MLflow disabled."""
    import json

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from fleetrl.trainer.tracking import tracking_dir

    folder = tracking_dir(config)
    rows = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]
    steps = list(range(1, trainer.step + 1))
    assert [r["step"] for r in rows if "table" not in r] == steps
    assert [r["step"] for r in rows if "table" in r] == [s for s in steps if s % 2 == 0]
    expected = {"train/reward_mean", "train/reward_std", "train/loss", "train/kl", "train/entropy",
                "train/clip_fraction", "train/grad_norm", "train/staleness_mean", "train/tokens_per_s",
                "train/groups", f"train/groups/{REGION}"}
    assert expected <= set(rows[0]) and rows[0]["train/entropy"] > 0
    assert [r["train/reward_mean"] for r in rows if "table" not in r] == pytest.approx(trainer.result.rewards)
    acc = EventAccumulator(str(folder / "tensorboard" / config.run))
    acc.Reload()
    for tag in expected:
        assert [e.step for e in acc.Scalars(tag)] == steps, tag
    assert set(trainer.tracking.log.failed()) == {"mlflow"}


async def test_an_unreachable_region_does_not_stop_training(make_fleet: Callable[..., FleetConfig]) -> None:
    """A second region whose cluster is down at start: its share goes to the region that answers."""
    from trainer_groups import answer_prompts

    from fleetrl.devstack import free_port

    base = make_fleet()
    data = base.model_dump(mode="json")
    data["kafka"]["request_timeout_s"] = 8.0
    data["regions"].append({**data["regions"][0], "name": "down-b", "kafka": {"bootstrap": f"127.0.0.1:{free_port()}"},
                            "nodes": []})
    config = FleetConfig.model_validate(data)
    await ensure_topics(config, REGION)
    trainer = Trainer(config, reverse_prompts, Learner(config.model, config.algorithm, DistContext()))
    answered: list[str] = []
    train = asyncio.create_task(trainer.run(max_steps=3))
    rollout = asyncio.create_task(answer_prompts(config, REGION, train.done, answered))
    result = await asyncio.wait_for(train, scaled(90))
    await asyncio.wait_for(rollout, scaled(30))
    assert result.steps == 3 and result.trained_groups == 6
    m = trainer.metrics.registry
    assert (m.get_sample_value("fleetrl_trainer_groups_dispatched_total", {"region": REGION}) or 0) >= 6
    assert m.get_sample_value("fleetrl_trainer_groups_dispatched_total", {"region": "down-b"}) is None


class HeldLearner(Learner):
    """A learner whose first step is held, once it has trained, until the test releases it: a step
    as long as the test needs (the test bounds the wait)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.in_step, self.release = threading.Event(), threading.Event()

    def train_step(self, batch: StepBatch) -> StepStats:
        stats = super().train_step(batch)
        self.in_step.set()
        self.release.wait(scaled(120))
        return stats


async def test_hostile_trajectories_are_dead_lettered_while_the_learner_steps(
        make_fleet: Callable[..., FleetConfig]) -> None:
    """A flood that arrives during a step is refused during that step, not only once it ends: the
    loop reads every region's trajectories while the learner computes."""
    from trainer_groups import answer_prompts

    config = make_fleet()
    await ensure_topics(config, REGION)
    learner = HeldLearner(config.model, config.algorithm, DistContext())
    trainer = Trainer(config, reverse_prompts, learner)
    answered: list[str] = []
    train = asyncio.create_task(trainer.run(max_steps=2))
    rollout = asyncio.create_task(answer_prompts(config, REGION, train.done, answered))
    try:
        assert await asyncio.to_thread(learner.in_step.wait, scaled(90)), "the first step never started"
        flood = 300
        async with Producer(config, REGION, "hostile") as prod:
            await asyncio.gather(*(prod.send_raw(topic_name(config.run, "trajectories"), b"hostile-%d" % i,
                                                 b"\xc1 not msgpack %d" % i, []) for i in range(flood)))
        assert trainer.clients is not None
        consumer = trainer.clients.consumers[REGION]
        for _ in range(round(scaled(600))):  # bounded: 60 s on the reference machine
            if consumer.dead_count >= flood:
                break
            await asyncio.sleep(0.1)
        assert consumer.dead_count >= flood and trainer.step == 0  # all refused, the first step still held
    finally:
        learner.release.set()
    result = await asyncio.wait_for(train, scaled(90))
    await asyncio.wait_for(rollout, scaled(30))
    assert result.steps == 2
    view = await read_topics(config)
    assert sum(1 for key, reasons in view.dead.items() if key.startswith("hostile-") and reasons == ["malformed"]) \
        == flood


class StepsHeld(Learner):
    """A learner whose first `held` steps each wait, once trained, until the test releases them."""

    def __init__(self, *args: Any, held: int = 2, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.in_step = [threading.Event() for _ in range(held)]
        self.release = [threading.Event() for _ in range(held)]
        self._steps = 0

    def train_step(self, batch: StepBatch) -> StepStats:
        stats = super().train_step(batch)
        i, self._steps = self._steps, self._steps + 1
        if i < len(self.in_step):
            self.in_step[i].set()
            self.release[i].wait(scaled(120))
        return stats


async def test_while_the_learner_steps_the_loop_buffers_the_next_step_and_sends_what_the_last_one_admitted(
        make_fleet: Callable[..., FleetConfig]) -> None:
    """Step 1 is held: the groups that arrive meanwhile are taken in (the next step's groups are
    buffered when it ends, not a poll later). Step 2 then starts straight away and is held: the groups
    that step 1's end admitted are sent while it computes, not once it is done. (The groups sent ahead
    for version 1 are answered once it is published, as a worker would.)"""
    from trainer_groups import answer_prompts

    config = make_fleet()
    gps = config.algorithm.groups_per_step
    window = (1 + config.algorithm.max_staleness) * gps
    sent_at_start = window + config.algorithm.dispatch_ahead_steps * gps
    await ensure_topics(config, REGION)
    learner = StepsHeld(config.model, config.algorithm, DistContext())
    trainer = Trainer(config, reverse_prompts, learner)
    answered: list[str] = []

    async def after_step_1_started(i: int) -> None:  # the groups past step 1's own come during it
        for _ in range(round(scaled(1200))):  # bounded: 60 s on the reference machine
            if i < gps or learner.in_step[0].is_set():
                return
            await asyncio.sleep(0.05)

    train = asyncio.create_task(trainer.run(max_steps=3))
    rollout = asyncio.create_task(answer_prompts(config, REGION, train.done, answered, after_step_1_started,
                                                 newest=lambda: trainer.version))
    sent = trainer.metrics.registry

    def dispatched() -> float:
        return sent.get_sample_value("fleetrl_trainer_groups_dispatched_total", {"region": REGION}) or 0.0

    async def until(what: Callable[[], bool], why: Callable[[], str]) -> None:
        for _ in range(round(scaled(600))):  # bounded: 60 s on the reference machine
            if what():
                return
            await asyncio.sleep(0.1)
        raise AssertionError(why())

    try:
        assert await asyncio.to_thread(learner.in_step[0].wait, scaled(90)), "the first step never started"
        await until(lambda: len(trainer.collector.pending) == window - gps,
                    lambda: f"the groups answered during step 1 were not taken in: {len(trainer.collector.pending)} "
                            "buffered")
        assert trainer.step == 0 and dispatched() == sent_at_start
        learner.release[0].set()
        assert await asyncio.to_thread(learner.in_step[1].wait, scaled(90)), "the second step never started"
        await until(lambda: dispatched() == sent_at_start + gps,
                    lambda: f"step 1's admissions were not sent during step 2: {dispatched()} sent")
        assert trainer.step == 1  # step 2 still computing
    finally:
        for event in learner.release:
            event.set()
    result = await asyncio.wait_for(train, scaled(90))
    await asyncio.wait_for(rollout, scaled(30))
    assert result.steps == 3
