"""The region rollout worker: partials and prompts in, finished groups out (DESIGN.md §1, §3).

One worker per node. It consumes `partials` before `prompts` in the region's rollout consumer
group, keeps up to `rollout.max_groups_in_flight` groups in its engine (their samples share the
engine's continuous batch), scores finished groups with the task's reward and produces them to
`trajectories`. A delivery's offset is committed only after the record it owes is acknowledged,
and in offset order per partition (`CommitQueue`), so a worker killed at any point leaves its
unfinished work to the next member of the group (at-least-once; the trainer deduplicates).

Groups leave the worker unfinished in three cases, always as a `fleetrl.partial/1` carrying every
token generated so far with its logprob and version, and `handed_over_by`:
* `min_version`: the weights the prompt asks for did not arrive within `rollout.min_version_wait_s`;
* `deadline`: the group ran longer than `rollout.group_deadline_s` here (long-tail cut);
* `sigterm` / `preempted`: the worker is stopping; it admits nothing more and hands over every
  unfinished group within `rollout.handover_timeout_s`, commits, and returns.
The engine steps in a thread; weights refresh in the background (`WeightSync`).

`RolloutWorker` only coordinates; each part owns one thing: `Intake` (rollout/intake.py) the
Kafka deliveries, `JobQueue` (rollout/scheduling.py) the admitted jobs and the engine's steps,
`EpisodeGroups` (rollout/episode_groups.py) the groups that run as episodes, `GroupPublisher`
(rollout/publisher.py) the records produced and `Committer` (rollout/commits.py) their offsets,
`Handover` (rollout/handover.py) the stop, `WorkerStats` (rollout/stats.py) the counters reported.

A group with an environment (`dataset.env`, the record's `env`) runs its samples as episodes
(rollout/episodes.py): each model turn is a one-sample request in the same engine, submitted and
withdrawn by this loop between steps, so turns of many episodes share the continuous batch while
environment steps run in their own threads. A skyrl-gym group is handed over as a restart (no samples):
its episodes begin again elsewhere, and the tokens given up are counted (`episode_tokens_discarded`); an
agent group leaves with each run's completed calls (`fleetrl.partial/2`), replayed where it resumes
(rollout/agent_replay.py).

With `engine.speculative.region_history` (torch engine, speculation on), the worker also follows its
region's `trajectories` without a consumer group and records every other worker's answers in its
engine's response history (rollout/region_history.py); an idle engine records them between polls.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from typing import Any

from fleetrl.broker import Consumer, PartialSample, Producer, RecordLimits, Sampling, rollout_group
from fleetrl.config import EnvConfig, FleetConfig
from fleetrl.hub import Hub
from fleetrl.log import get_logger
from fleetrl.rollout.commits import Committer
from fleetrl.rollout.engine import Engine
from fleetrl.rollout.episode_groups import EpisodeGroups
from fleetrl.rollout.eval_lane import EvalLane
from fleetrl.rollout.handover import Handover
from fleetrl.rollout.intake import IDLE_WAKE_S, Intake
from fleetrl.rollout.jobs import Job
from fleetrl.rollout.nodes import engine_config, engine_devices
from fleetrl.rollout.publisher import GroupPublisher
from fleetrl.rollout.region_history import RegionHistory
from fleetrl.rollout.rewards import build_rewards
from fleetrl.rollout.scheduling import JobQueue
from fleetrl.rollout.stats import RATE_WINDOW_S, WorkerCounters, WorkerStats
from fleetrl.rollout.tasks import get_task
from fleetrl.rollout.tokenize import TextCodec, load_codec
from fleetrl.rollout.weights import WeightSync

log = get_logger(__name__)
__all__ = ["RATE_WINDOW_S", "RolloutWorker", "build_engine", "run_worker"]


def build_engine(config: FleetConfig, region: str, node: str, engine_index: int = 0) -> Engine:
    """Engine `engine_index` of a node. A torch engine runs on its entry of `engine.devices`; a vLLM
    engine sees its GPUs through CUDA_VISIBLE_DEVICES, which the region agent sets per engine."""
    engine_cfg = engine_config(config, region, node)
    if engine_cfg.kind == "vllm":
        from fleetrl.rollout.vllm_engine import VllmEngine

        return VllmEngine.from_config(config.model, engine_cfg)
    from fleetrl.rollout.torch_engine import TorchEngine

    device = engine_devices(config, region, node)[engine_index]
    return TorchEngine.from_config(config.model, engine_cfg.model_copy(update={"device": device}),
                                   length_aware=config.rollout.length_aware)


class RolloutWorker:
    """One node's worker loop; `run()` returns after a clean handover."""

    producer: Producer
    consumer: Consumer
    """The worker's Kafka clients, once `run()` opened them."""

    def __init__(self, config: FleetConfig, region: str, node: str, engine: Engine | None = None,
                 hub: Hub | None = None, codec: TextCodec | None = None,
                 eval_engine: Callable[[], Engine] | None = None) -> None:
        config.region(region)
        self.config, self.region, self.node, self.cfg = config, region, node, config.rollout
        self.engine = engine if engine is not None else build_engine(config, region, node)
        self.hub = hub if hub is not None else Hub.from_config(config, store=region)
        self.codec = codec if codec is not None else load_codec(config.model, sorted(self.engine.eos_ids))
        emulate = getattr(engine_config(config, region, node), "emulate", None)
        self.weights = WeightSync(self.hub, self.engine, self.cfg.weight_fallback_poll_s,
                                  transfer_s=emulate.weight_transfer_s if emulate is not None else 0.0)
        self.rewards = build_rewards(config.reward, get_task)
        """The task's built-in reward, or `reward.functions` / `reward.url` (rollout/rewards.py)."""
        self.handover_timeout_s = self.cfg.handover_timeout_s
        """Bound of the handover on stop (a preemption notice with a short window lowers it)."""
        self.stop_reason = "sigterm"
        """Reason written into partials handed over when `stop` is set (the agent sets `drain`, `stop`)."""
        self.client_id = f"fleetrl-rollout-{region}-{node}"
        self.region_history = self._region_history()
        """Feeds the engine's history with the region's answers (`engine.speculative.region_history`), or None."""
        self._feed: asyncio.Task[None] | None = None
        self._lane: asyncio.Task[None] | None = None
        self.counters = WorkerCounters()
        self.commits = Committer()
        self.publisher = GroupPublisher(region, node, self.rewards, self.codec, self.commits, self.counters,
                                        self.region_history)
        self.queue = JobQueue(self.engine, self.cfg, self.publisher, self.counters)
        self.episodes = EpisodeGroups(config, self.engine, self.codec, self.queue, self.publisher, self.counters,
                                      lambda rid, context, sampling: self._generate_turn(rid, context, sampling))
        self.intake = Intake(config, self.codec, self.queue, self.publisher, self.commits, self.counters,
                             lambda: self.episodes.env_cfg)
        self.eval_lane = EvalLane(config, self.publisher, eval_engine or (lambda: build_engine(config, region, node)),
                                  Hub.from_config(config, store=region), self._held, self.cfg.max_groups_in_flight,
                                  seed=self.cfg.seed)
        """Eval prompts, each generated with exactly its pinned version (rollout/eval_lane.py)."""
        self.intake.eval_lane = self.eval_lane
        self.handover = Handover(self.queue, self.episodes, self.publisher, self.commits, self.eval_lane)
        self._stats = WorkerStats(self.counters, self.engine, self.weights, self.rewards, self.region_history,
                                  lambda: len(self.queue), self.cfg.stats_interval_s)

    def _region_history(self) -> RegionHistory | None:
        spec = getattr(engine_config(self.config, self.region, self.node), "speculative", None)
        if spec is None or not (spec.enabled and spec.region_history):
            return None
        return RegionHistory(self.config, self.region, self.engine, f"{self.client_id}-history",
                             window=spec.region_history_window, poll_s=self.cfg.idle_poll_s)

    def _held(self) -> int | None:
        """The newest version the region store is known to hold (the eval lane loads no newer one)."""
        known = [v for v in (self.weights.have, self.weights.announced) if v is not None]
        return max(known) if known else None

    def stats(self) -> dict[str, Any]:
        """Counters for heartbeats and logs (the region agent reports them)."""
        return self._stats.stats()

    async def run(self, stop: asyncio.Event, preempted: asyncio.Event | None = None) -> None:
        """Work until `stop` (reason `self.stop_reason`) or `preempted` is set, then hand over and return."""
        try:
            await self._run(stop, preempted)
        finally:
            self.hub.close()
            self.eval_lane.hub.close()
            self.eval_lane.close()
            await self.episodes.close()

    async def _run(self, stop: asyncio.Event, preempted: asyncio.Event | None) -> None:
        if self.region_history is not None:  # warms the history while the weights load
            self._feed = asyncio.create_task(self.region_history.run(), name="region-history")
        try:
            await self._work(stop, preempted)
        finally:
            await self._stop_feed()

    async def _work(self, stop: asyncio.Event, preempted: asyncio.Event | None) -> None:
        limits = RecordLimits.from_config(self.config)
        async with Producer(self.config, self.region, self.client_id,
                            on_dead_letter=self.counters.count_dead_letter) as producer:
            self.producer = self.publisher.producer = producer
            async with Consumer(self.config, self.region, ["partials", "prompts"], rollout_group(self.config.run),
                                limits, producer, self.client_id, priority=True, on_assigned=self.intake.on_assigned,
                                join_in_background=True, session_timeout_s=self.cfg.group_session_timeout_s,
                                heartbeat_interval_s=min(1.0, self.cfg.group_session_timeout_s / 4)) as consumer:
                self.consumer = self.intake.consumer = self.commits.consumer = consumer
                if not await self.weights.load_first(lambda: stop.is_set() or bool(preempted and preempted.is_set())):
                    return
                poller = asyncio.create_task(self.weights.run(), name="weight-sync")
                intake = asyncio.create_task(self.intake.run(), name="intake")
                self._lane = asyncio.create_task(self.eval_lane.run(), name="eval-lane")
                try:
                    reason = await self._loop(stop, preempted, intake)
                finally:
                    poller.cancel()
                    self.intake.admitting = False
                await self.intake.stop(intake, reason, self.handover_timeout_s)
                await self.eval_lane.stop(self._lane, self.handover_timeout_s / 4)
                await self._hand_over(reason)

    # -- the loop -------------------------------------------------------------------------------

    async def _loop(self, stop: asyncio.Event, preempted: asyncio.Event | None, intake: asyncio.Task[None]) -> str:
        log.info("worker.started", region=self.region, node=self.node, version=self.engine.version)
        while True:
            if preempted is not None and preempted.is_set():
                return "preempted"
            if stop.is_set():
                return self.stop_reason
            self._surface(intake)
            self.queue.start_ready(self.episodes.start)
            self.episodes.sync_turns()
            if self.queue.has_work():
                for group in await self.queue.step():
                    if not self.episodes.deliver(group):
                        self.queue.finish(group)
            elif self.engine.observed_waiting:
                # Idle, with the region's answers waiting: record a step's worth (the engine's thread; the
                # loop comes back at once for new work).
                await asyncio.to_thread(self.engine.record_observed)
            else:
                await self.queue.idle(IDLE_WAKE_S)  # wakes on new work, or soon enough to see a stop or a version
            self.queue.cut_long_tail()
            self.publisher.surface_errors()
            self.episodes.surface_errors()
            self._stats.maybe_log()

    def _surface(self, intake: asyncio.Task[None]) -> None:
        """A background part that ended raises here: its exception stops the worker."""
        if intake.done():
            intake.result()  # the intake died: surface why
        if self._lane is not None and self._lane.done():
            self._lane.result()  # the eval lane died: surface why
        if self._feed is not None and self._feed.done():
            self._feed.result()  # it retries Kafka failures itself: anything else is a bug to surface

    async def _hand_over(self, reason: str) -> None:
        started = time.monotonic()
        if not await self.handover.bounded(reason, self.handover_timeout_s):
            return
        c = self.counters
        self._stats.log_now(final=True)
        log.info("worker.stopped", reason=reason, seconds=round(time.monotonic() - started, 3),
                 groups_done=c.groups_done, handed_over=dict(c.handed_over_by_reason),
                 engine_busy_s=round(c.engine_busy_s, 3), tokens_sampled=self.engine.tokens_sampled,
                 uptime_s=round(self._stats.uptime_s(), 3))

    async def _stop_feed(self) -> None:
        feed, self._feed = self._feed, None
        if feed is None:
            return
        feed.cancel()
        await asyncio.wait([feed], timeout=self.config.kafka.request_timeout_s)  # its client stops bounded
        if feed.done() and not feed.cancelled() and feed.exception() is not None:
            log.error("worker.region_history_failed", error=repr(feed.exception()))

    def _generate_turn(self, request_id: str, context: list[int], sampling: Sampling) -> Awaitable[PartialSample]:
        """One model turn of an episode (the seam through which episode runners reach the engine)."""
        return self.episodes.generate_turn(request_id, context, sampling)

    # -- the parts' state under the worker's own names (the region agent, benches and tests read them)

    @property
    def env_cfg(self) -> EnvConfig | None:
        return self.episodes.env_cfg

    @property
    def _jobs(self) -> dict[str, Job]:
        return self.queue.running

    @property
    def _waiting(self) -> list[Job]:
        return self.queue.waiting

    @property
    def _have_since(self) -> float:
        return self.queue.have_since

    @property
    def groups_done(self) -> int:
        return self.counters.groups_done

    @property
    def groups_handed_over(self) -> int:
        return self.counters.groups_handed_over

    @property
    def handed_over_by_reason(self) -> Counter[str]:
        return self.counters.handed_over_by_reason

    @property
    def dead_lettered(self) -> Counter[str]:
        return self.counters.dead_lettered

    @property
    def redelivered(self) -> int:
        return self.counters.redelivered

    @property
    def polls_cancelled(self) -> int:
        return self.counters.polls_cancelled

    @property
    def episodes_failed(self) -> int:
        return self.counters.episodes_failed

    @property
    def episode_tokens_discarded(self) -> int:
        return self.counters.episode_tokens_discarded

    @property
    def tokens_generated(self) -> int:
        return self.counters.tokens_generated

    @property
    def engine_steps(self) -> int:
        return self.counters.engine_steps

    @property
    def engine_busy_s(self) -> float:
        return self.counters.engine_busy_s


async def run_worker(config: FleetConfig, region: str, node: str, stop: asyncio.Event,
                     engine: Engine | None = None, preempted: asyncio.Event | None = None) -> None:
    """Run one node's rollout worker until `stop` (SIGTERM) or `preempted`; hand over and return."""
    await RolloutWorker(config, region, node, engine=engine).run(stop, preempted)
