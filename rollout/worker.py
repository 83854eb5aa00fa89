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

A group with an environment (`dataset.env`, the record's `env`) runs its samples as episodes
(rollout/episodes.py): each model turn is a one-sample request in the same engine, submitted and
withdrawn by this loop between steps, so turns of many episodes share the continuous batch while
environment steps run in their own threads. Such a group is handed over as a restart (no samples):
its episodes begin again elsewhere, and the tokens given up are counted (`episode_tokens_discarded`).

With `engine.speculative.region_history` (torch engine, speculation on), the worker also follows its
region's `trajectories` without a consumer group and records every other worker's answers in its
engine's response history (rollout/region_history.py); an idle engine records them between polls.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import Counter, deque
from collections.abc import Coroutine
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from fleetrl.broker import (
    Consumer,
    Delivery,
    GroupRecord,
    KafkaError,
    PartialSample,
    Producer,
    RecordError,
    RecordLimits,
    Sampling,
    encode_record,
    floats,
    ids,
    rollout_group,
)
from fleetrl.config import FleetConfig
from fleetrl.crashpoints import crash_point
from fleetrl.hub import Hub
from fleetrl.log import get_logger
from fleetrl.rollout.commits import CommitQueue
from fleetrl.rollout.engine import Engine, FinishedGroup, GroupRequest
from fleetrl.rollout.episodes import EpisodeRunner, TurnTemplate, load_env_factory
from fleetrl.rollout.errors import EngineError, EnvError, RewardError, TaskError
from fleetrl.rollout.jobs import Job, group_record, partial_record, reward_input
from fleetrl.rollout.nodes import engine_config, engine_devices
from fleetrl.rollout.region_history import RegionHistory
from fleetrl.rollout.rewards import build_rewards
from fleetrl.rollout.tasks import get_task
from fleetrl.rollout.tokenize import TextCodec, load_codec
from fleetrl.rollout.weights import WeightSync

log = get_logger(__name__)
RATE_WINDOW_S = 30.0
_IDLE_WAKE_S = 0.05  # an idle loop's longest nap: bounds how late it sees a stop or new weights


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

    def __init__(self, config: FleetConfig, region: str, node: str, engine: Engine | None = None,
                 hub: Hub | None = None, codec: TextCodec | None = None) -> None:
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
        self.engine_steps = 0
        """Decoding steps taken: the region agent's hang check watches it move while there is work."""
        self.client_id = f"fleetrl-rollout-{region}-{node}"
        self._jobs: dict[str, Job] = {}  # admitted, not yet handed to a record
        self._waiting: list[Job] = []  # admitted, waiting for min_version or a decoding slot
        self._have, self._have_since = -1, time.monotonic()  # newest version here, since when
        self._commits = CommitQueue()
        self._commit_lock = asyncio.Lock()
        self._tasks: set[asyncio.Task[None]] = set()
        self.engine_busy_s = 0.0
        """Seconds spent in engine steps (decoding, applying weights): the rest of the worker's life
        the engine was idle (no work, waiting for a version, or starting)."""
        self.groups_done = 0
        self.episodes_failed = 0
        """Episodes that ended on an environment error with the failure reward (`env.on_error`)."""
        self.groups_handed_over = 0
        self.redelivered = 0
        """Records delivered again after a rebalance while this worker still held them (not work twice)."""
        self.handed_over_by_reason: Counter[str] = Counter()
        """Groups handed back as partials, by the reason each carries in `handed_over_by` (listed above)."""
        self.dead_lettered: Counter[str] = Counter()
        """Records this worker sent to the dead-letter topic, by reason (bad prompts, failed rewards)."""
        self.tokens_generated = 0
        self._started = self._last_stats = time.monotonic()
        # (time, engine.tokens_sampled) samples: the reported rate covers the recent window only,
        # so a worker that sat idle (drained, starved) reports what it does now, not its lifetime mean
        self._rate_samples: deque[tuple[float, int]] = deque([(self._started, self.engine.tokens_sampled)])
        self._admitting = True
        self._polling = False  # the intake is inside a poll
        self.polls_cancelled = 0
        """Polls cut short by a preemption (their records stay in Kafka for the partition's next owner)."""
        self._work_arrived = asyncio.Event()
        self.env_cfg = config.dataset.env
        self._env_pool: ThreadPoolExecutor | None = None
        self._episodes: dict[str, asyncio.Task[None]] = {}  # group id -> its episodes' task
        self._runners: dict[str, EpisodeRunner] = {}  # group id -> its episodes' runner
        self._turns: dict[str, asyncio.Future[list[PartialSample]]] = {}  # turn request id -> its result
        self._turn_queue: list[GroupRequest] = []  # turns to submit before the next step
        self._turn_withdraw: list[str] = []  # turns of cancelled episodes to take out before the next step
        self.episode_tokens_discarded = 0
        """Tokens of episodes handed over unfinished: they are generated again where the episode restarts."""
        self.stop_reason = "sigterm"
        """Reason written into partials handed over when `stop` is set (the agent sets `drain`, `stop`)."""
        self.region_history = self._region_history()
        """Feeds the engine's history with the region's answers (`engine.speculative.region_history`), or None."""
        self._feed: asyncio.Task[None] | None = None

    def _region_history(self) -> RegionHistory | None:
        spec = getattr(engine_config(self.config, self.region, self.node), "speculative", None)
        if spec is None or not (spec.enabled and spec.region_history):
            return None
        return RegionHistory(self.config, self.region, self.engine, f"{self.client_id}-history",
                             window=spec.region_history_window, poll_s=self.cfg.idle_poll_s)

    async def run(self, stop: asyncio.Event, preempted: asyncio.Event | None = None) -> None:
        """Work until `stop` (reason `self.stop_reason`) or `preempted` is set, then hand over and return."""
        try:
            await self._run(stop, preempted)
        finally:
            self.hub.close()
            if self._env_pool is not None:
                self._env_pool.shutdown(wait=False, cancel_futures=True)  # a hanging tool keeps only its thread

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
                            on_dead_letter=self._count_dead_letter) as producer:
            self.producer = producer
            async with Consumer(self.config, self.region, ["partials", "prompts"], rollout_group(self.config.run),
                                limits, producer, self.client_id, priority=True, on_assigned=self._on_assigned,
                                join_in_background=True, session_timeout_s=self.cfg.group_session_timeout_s,
                                heartbeat_interval_s=min(1.0, self.cfg.group_session_timeout_s / 4)) as consumer:
                self.consumer = consumer
                if not await self.weights.load_first(lambda: stop.is_set() or bool(preempted and preempted.is_set())):
                    return
                poller = asyncio.create_task(self.weights.run(), name="weight-sync")
                intake = asyncio.create_task(self._intake(), name="intake")
                try:
                    reason = await self._loop(stop, preempted, intake)
                finally:
                    poller.cancel()
                    self._admitting = False
                await self._stop_intake(intake, reason)
                await self._bounded_handover(reason)

    # -- the loop -------------------------------------------------------------------------------

    async def _loop(self, stop: asyncio.Event, preempted: asyncio.Event | None, intake: asyncio.Task[None]) -> str:
        log.info("worker.started", region=self.region, node=self.node, version=self.engine.version)
        while True:
            if preempted is not None and preempted.is_set():
                return "preempted"
            if stop.is_set():
                return self.stop_reason
            if intake.done():
                intake.result()  # the intake died: surface why
            if self._feed is not None and self._feed.done():
                self._feed.result()  # it retries Kafka failures itself: anything else is a bug to surface
            self._start_ready_jobs()
            self._sync_turns()
            if self.engine.has_work() or self.engine.has_staged():
                t0 = time.monotonic()
                for group in await asyncio.to_thread(self.engine.step):
                    turn = self._turns.get(group.group_id)
                    if turn is not None:
                        if not turn.done():
                            turn.set_result(group.samples)
                    else:
                        self._spawn(self._finish(group))
                self.engine_steps += 1
                self.engine_busy_s += time.monotonic() - t0
            elif self.engine.observed_waiting:
                # Idle, with the region's answers waiting: record a step's worth (the engine's thread; the
                # loop comes back at once for new work).
                await asyncio.to_thread(self.engine.record_observed)
            else:
                # Idle: wake on new work, or soon enough to see a stop or a min_version arrive.
                self._work_arrived.clear()
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(_IDLE_WAKE_S):
                        await self._work_arrived.wait()
            self._cut_long_tail()
            self._surface_task_errors()
            self._maybe_log_stats()

    async def _intake(self) -> None:
        """Poll Kafka beside the engine (a poll costs round trips) whenever a group slot is free."""
        next_skim = 0.0
        while self._admitting:
            dead_before = self.consumer.dead_count
            # Up to `max_groups_in_flight` decode, and as many more may wait here for their weights
            # (prompts the trainer sent ahead: they start the moment the version lands).
            free = 2 * self.cfg.max_groups_in_flight - len(self._jobs) - len(self._waiting)
            if free <= 0:
                # No room for a group, but hostile records at the head of the partitions need none:
                # dead-letter them now rather than let a flood wait in front of the good prompts.
                if time.monotonic() >= next_skim:
                    next_skim = time.monotonic() + self.cfg.idle_poll_s
                    await self.consumer.skim()
                await asyncio.sleep(_IDLE_WAKE_S)
            else:
                self._polling = True
                try:
                    deliveries = await self.consumer.poll(free, self.cfg.idle_poll_s)
                finally:
                    self._polling = False
                for d in deliveries:
                    self._take_on(d)
            if self.consumer.dead_count > dead_before:
                await self._commit_dead_letters()

    async def _commit_dead_letters(self) -> None:
        """Commit past dead letters now, up to the first offset still owed an effect: otherwise a worker
        that completes no further group on that partition would leave them to be re-read and
        dead-lettered again by whoever reads it next."""
        try:
            async with self._commit_lock:
                await self.consumer.commit([])
        except KafkaError as exc:  # the dead letters are safe in their topic; at worst they are re-read
            log.warning("worker.dead_letter_commit_failed", error=str(exc))

    def _take_on(self, d: Delivery) -> None:
        if self._commits.owes(d):
            # The same record again (a rebalance reset the position to the committed offset): the delivery
            # taken on first still owes its effect; marking this one done would commit it early.
            self.redelivered += 1
            log.info("worker.redelivered", stream=d.stream, partition=d.partition, offset=d.offset)
            return
        self._commits.owe(d)
        if self._commits.handed_out(d):  # its group was produced; the commit was lost to a rebalance
            self.redelivered += 1
            log.info("worker.redelivered", stream=d.stream, partition=d.partition, offset=d.offset, produced=True)
            self._spawn(self._mark_done(d))
            return
        try:
            job = Job.from_delivery(d, self.codec)
        except TaskError as exc:  # a chat prompt the tokenizer cannot render
            self._spawn(self._dead_letter(d, "render_error", str(exc), "messages"))
            return
        limit = self.config.dataset.max_prompt_tokens
        if len(job.prompt_ids) > limit:
            self._spawn(self._dead_letter(d, "tokens_bound", f"rendered prompt of {len(job.prompt_ids)} tokens > "
                                          f"{limit} (dataset.max_prompt_tokens)", "messages"))
            return
        if job.group_id in self._jobs or any(w.group_id == job.group_id for w in self._waiting):
            # A second delivery of a group already here (a redispatch): the first one's record serves.
            log.info("worker.duplicate_delivery", group_id=job.group_id, offset=d.offset)
            self._spawn(self._mark_done(d))
            return
        job.resolve_env(self.env_cfg)
        log.info("worker.admitted", group_id=job.group_id, stream=d.stream, offset=d.offset)
        self._waiting.append(job)
        self._work_arrived.set()

    def _on_assigned(self, owned: set[tuple[str, int]]) -> None:
        """After a rebalance: give up the admitted groups not yet started whose partition went to another
        member (it reads them again from the committed offset; starting them here would generate them
        twice). Groups already decoding stay: their effect may still arrive first."""
        started = {(job.delivery.tp, job.delivery.offset) for job in self._jobs.values()}
        gone = self._commits.forget(lambda d: d.tp in owned or (d.tp, d.offset) in started)
        released = {(d.tp, d.offset) for d in gone}
        if not released:
            return
        before = len(self._waiting)
        self._waiting = [job for job in self._waiting if (job.delivery.tp, job.delivery.offset) not in released]
        log.info("worker.released", groups=before - len(self._waiting), offsets=len(released))

    async def _stop_intake(self, intake: asyncio.Task[None], reason: str) -> None:
        """Let a poll in progress finish (its records join the handover); cancel one that hangs.

        On a preemption a poll is cancelled at once: its records would only be handed over unstarted,
        and uncommitted they are read again by their partition's next owner; a poll held by a rebalance
        (a spot region's group changes members every few seconds) kept the going node, paid, and its
        partials waiting, for up to half the handover bound."""
        if reason == "preempted" and self._polling:
            intake.cancel()
            await asyncio.wait([intake], timeout=self.config.kafka.request_timeout_s)
            self.polls_cancelled += 1
            log.info("worker.poll_cancelled", reason=reason)
            return
        try:
            await asyncio.wait_for(intake, timeout=self.handover_timeout_s / 2)
        except TimeoutError:
            log.warning("worker.intake_cancelled")

    def _start_ready_jobs(self) -> None:
        """Submit jobs whose min_version the engine has (or has staged), oldest first while a decoding
        slot is free; hand back those that waited too long: `min_version_wait_s` with no new version
        landing here (a prompt sent ahead waits for a step or more while versions keep coming)."""
        have = max(self.engine.version, self.engine.staged_version or -1)
        now = time.monotonic()
        if have != self._have:
            self._have, self._have_since = have, now
        still: list[Job] = []
        for job in self._waiting:
            if job.prompt.min_version <= have:
                if len(self._jobs) < self.cfg.max_groups_in_flight:
                    self._submit(job)
                else:
                    still.append(job)
            elif now - max(job.received_mono, self._have_since) > self.cfg.min_version_wait_s:
                log.info("worker.min_version_timeout", group_id=job.group_id, min_version=job.prompt.min_version,
                         have=have)
                self._spawn(self._hand_over(job, None, "min_version"))
            else:
                still.append(job)
        self._waiting = still

    def _submit(self, job: Job) -> None:
        p = job.prompt
        job.start()
        self._jobs[job.group_id] = job
        if job.env is not None:
            self._episodes[job.group_id] = asyncio.create_task(self._run_episodes(job), name=f"episodes-{job.group_id}")
            return
        self.engine.submit(GroupRequest(p.group_id, job.prompt_ids, p.sampling, p.n_samples,
                                        seed=self.cfg.seed, resume=job.resume))

    def _cut_long_tail(self) -> None:
        now = time.monotonic()
        for gid, job in list(self._jobs.items()):
            if job.started_mono is not None and now - job.started_mono > self.cfg.group_deadline_s \
                    and gid in self.engine.group_ids():
                samples = self.engine.take(gid)
                log.info("worker.deadline_cut", group_id=gid, tokens=sum(len(s.completion_ids) for s in samples))
                self._spawn(self._hand_over(self._jobs.pop(gid), samples, "deadline"))

    def stats(self) -> dict[str, Any]:
        """Counters for heartbeats and logs (the region agent reports them)."""
        in_flight = sum(self.engine.tokens_so_far(g) for g in self.engine.group_ids())
        return {"groups_done": self.groups_done, "episodes_failed": self.episodes_failed,
                "episode_tokens_discarded": self.episode_tokens_discarded, "handed_over": self.groups_handed_over,
                "dead_lettered": dict(self.dead_lettered),
                "groups_in_flight": len(self._jobs) + len(self._waiting), "tokens_in_flight": in_flight,
                "tokens_per_s": round(self._recent_tokens_per_s(), 2), "version": self.engine.version,
                "busy_tokens_per_s": round(self.engine.tokens_sampled / self.engine_busy_s, 2)
                if self.engine_busy_s > 0 else 0.0,
                "weights": self.weights.have,
                "rewards": {name: st.as_dict() for name, st in self.rewards.stats.items()},
                "engine_steps": self.engine_steps, "busy": self.engine.has_work(),
                **self._region_stats(),
                "engine_busy_s": round(self.engine_busy_s, 3), "tokens_sampled": self.engine.tokens_sampled,
                "uptime_s": round(time.monotonic() - self._started, 3)}

    def _region_stats(self) -> dict[str, Any]:
        """The region history's counters (zero without it): answers recorded, records skipped as bad."""
        feed = self.region_history.stats if self.region_history is not None else None
        return {"region_responses": self.engine.responses_observed,
                "region_responses_dropped": self.engine.responses_dropped,
                "region_records": feed.records if feed is not None else 0,
                "region_own": feed.own if feed is not None else 0,
                "region_skipped": feed.skipped if feed is not None else 0}

    def _recent_tokens_per_s(self) -> float:
        """Tokens sampled per second over about the last RATE_WINDOW_S seconds."""
        now, total = time.monotonic(), self.engine.tokens_sampled
        samples = self._rate_samples
        samples.append((now, total))
        while len(samples) > 2 and now - samples[1][0] >= RATE_WINDOW_S:
            samples.popleft()
        t0, n0 = samples[0]
        return (total - n0) / max(now - t0, 1e-9)

    def _maybe_log_stats(self) -> None:
        now = time.monotonic()
        if now - self._last_stats >= self.cfg.stats_interval_s:
            self._last_stats = now
            log.info("worker.stats", **self.stats())

    # -- effects: a record produced, then the offset committed ---------------------------------

    async def _finish(self, group: FinishedGroup) -> None:
        job = self._jobs.pop(group.group_id)
        try:
            scores = await self.rewards.score(job.prompt.task, reward_input(job, group.samples, self.codec))
        except RewardError as exc:  # the user's reward failed on this group: it goes, the worker goes on
            log.warning("worker.reward_error", group_id=job.group_id, error=str(exc))
            await self._dead_letter(job.delivery, "reward_error", str(exc), "reward")
            return
        except TaskError as exc:
            await self._dead_letter(job.delivery, "reward", str(exc), "reference")
            return
        record = group_record(job, group.samples, scores.rewards, self.region, self.node, scores.parts)
        self._mine(record)
        await self.producer.send("trajectories", group.group_id, record)
        crash_point("rollout.group.produced")
        self.groups_done += 1
        self.tokens_generated += sum(len(s.completion_ids) for s in group.samples)
        log.info("worker.group_done", group_id=group.group_id, reward=round(
            sum(s.reward for s in record.samples) / len(record.samples), 4))
        await self._mark_done(job.delivery)

    async def _hand_over(self, job: Job, samples: Any, reason: str) -> None:
        record = partial_record(job, samples, self.region, self.node, reason)
        await self.producer.send("partials", job.group_id, record)
        crash_point("rollout.partial.produced")
        self.groups_handed_over += 1
        self.handed_over_by_reason[reason] += 1
        log.info("worker.handed_over", group_id=job.group_id, reason=reason,
                 tokens=sum(len(s.completion_ids) for s in record.samples))
        await self._mark_done(job.delivery)

    def _mine(self, record: GroupRecord) -> None:
        """Before producing: the region history skips the group when it comes back (the engine has it)."""
        if self.region_history is not None:
            self.region_history.mine(record.group_id, record.attempt)

    async def _stop_feed(self) -> None:
        feed, self._feed = self._feed, None
        if feed is None:
            return
        feed.cancel()
        await asyncio.wait([feed], timeout=self.config.kafka.request_timeout_s)  # its client stops bounded
        if feed.done() and not feed.cancelled() and feed.exception() is not None:
            log.error("worker.region_history_failed", error=repr(feed.exception()))

    def _count_dead_letter(self, reason: str) -> None:
        self.dead_lettered[reason] += 1

    async def _dead_letter(self, d: Delivery, reason: str, message: str, field: str) -> None:
        """Send the delivery's record to `dead-letter` with `reason`, then count its offset done."""
        group_id = getattr(d.record, "group_id", None)
        err = RecordError(reason, message, field=field, group_id=group_id).at(d.topic, d.partition, d.offset)
        await self.producer.dead_letter(d.key.encode() if d.key else None, encode_record(d.record), err,
                                        d.topic, d.partition, d.offset)
        await self._mark_done(d)

    async def _mark_done(self, d: Delivery) -> None:
        self._commits.done(d)
        async with self._commit_lock:
            ready = self._commits.ready()
            if ready:
                await self.consumer.commit(ready)
                crash_point("rollout.offsets.committed")

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.create_task(coro)
        self._tasks.add(task)

    def _surface_task_errors(self) -> None:
        for task in [t for t in self._tasks if t.done()]:
            self._tasks.discard(task)
            task.result()  # an effect that failed beyond its retries stops the worker (nothing committed)
        for gid, task in [(g, t) for g, t in self._episodes.items() if t.done()]:
            del self._episodes[gid]
            if not task.cancelled():
                task.result()

    # -- episodes (rollout/episodes.py) ----------------------------------------------------------

    def _sync_turns(self) -> None:
        """Between steps (the engine is not stepping): withdraw cancelled turns, submit new ones."""
        for rid in self._turn_withdraw:
            if rid in self.engine.group_ids():
                self.engine.take(rid)
        self._turn_withdraw.clear()
        queue, self._turn_queue = self._turn_queue, []
        for request in queue:
            turn = self._turns.get(request.group_id)
            if turn is None or turn.done():
                continue
            try:
                self.engine.submit(request)
            except EngineError:  # the context is full: the turn is empty and ends its episode
                turn.set_result([PartialSample(ids([]), floats([]), ids([]), "length")])

    async def _generate_turn(self, request_id: str, context: list[int], sampling: Sampling) -> PartialSample:
        """One model turn of an episode, decoded by this worker's engine beside everything else."""
        turn: asyncio.Future[list[PartialSample]] = asyncio.get_running_loop().create_future()
        self._turns[request_id] = turn
        self._turn_queue.append(GroupRequest(request_id, context, sampling, 1, seed=self.cfg.seed))
        self._work_arrived.set()
        try:
            return (await turn)[0]
        except asyncio.CancelledError:
            self._turn_withdraw.append(request_id)
            raise
        finally:
            self._turns.pop(request_id, None)

    def _episode_runner(self, job: Job) -> EpisodeRunner:
        cfg = self.env_cfg
        if cfg is None:  # a record that names its own environment in a run without dataset.env
            from fleetrl.config import EnvConfig

            cfg = self.env_cfg = EnvConfig(name=job.env["name"] if job.env else "")
        if self._env_pool is None:
            self._env_pool = ThreadPoolExecutor(cfg.threads, thread_name_prefix="fleetrl-env")
        assert job.env is not None
        budget = cfg.max_episode_tokens or self.config.algorithm.max_new_tokens
        return EpisodeRunner(cfg, load_env_factory(job.env["name"], cfg.python_path), self.codec,
                             TurnTemplate(self.codec, sorted(self.engine.eos_ids)), self._env_pool,
                             self._generate_turn, budget)

    async def _run_episodes(self, job: Job) -> None:
        try:
            runner = self._runners[job.group_id] = self._episode_runner(job)
            results = await runner.run_group(job.group_id, job.prompt, job.prompt_ids,
                                             (job.env or {}).get("args") or {})
        except (EnvError, TaskError) as exc:  # a group whose environment failed: it goes, the worker goes on
            log.warning("worker.env_error", group_id=job.group_id, error=str(exc))
            self._jobs.pop(job.group_id, None)
            self._runners.pop(job.group_id, None)
            await self._dead_letter(job.delivery, "env_error", str(exc), "env")
            return
        self._jobs.pop(job.group_id, None)
        self._runners.pop(job.group_id, None)
        for r in results:
            if r.error is not None:
                self.episodes_failed += 1
                log.warning("worker.episode_failed", group_id=job.group_id, error=r.error)
        record = group_record(job, [r.sample for r in results], [r.reward for r in results], self.region,
                              self.node, sources=[r.segments for r in results])
        self._mine(record)
        await self.producer.send("trajectories", job.group_id, record)
        crash_point("rollout.group.produced")
        self.groups_done += 1
        self.tokens_generated += sum(int((r.sample.versions >= 0).sum()) for r in results)
        log.info("worker.group_done", group_id=job.group_id, episodes=len(results),
                 turns=sum(r.turns for r in results),
                 reward=round(sum(r.reward for r in results) / len(results), 4))
        await self._mark_done(job.delivery)

    # -- handover -------------------------------------------------------------------------------

    async def _bounded_handover(self, reason: str) -> None:
        started = time.monotonic()
        try:
            await asyncio.wait_for(self._handover(reason), timeout=self.handover_timeout_s)
        except TimeoutError:
            log.error("worker.handover_timeout", timeout_s=self.handover_timeout_s,
                      uncommitted=self._commits.outstanding())
            return
        log.info("worker.stopped", reason=reason, seconds=round(time.monotonic() - started, 3),
                 groups_done=self.groups_done, handed_over=dict(self.handed_over_by_reason),
                 engine_busy_s=round(self.engine_busy_s, 3), tokens_sampled=self.engine.tokens_sampled,
                 uptime_s=round(time.monotonic() - self._started, 3))

    async def _handover(self, reason: str) -> None:
        """Publish every unfinished group as a partial, let in-flight records land, commit."""
        for gid in list(self._jobs):
            if gid in self.engine.group_ids():
                self._spawn(self._hand_over(self._jobs.pop(gid), self.engine.take(gid), reason))
        for gid, task in list(self._episodes.items()):
            task.cancel()  # its episodes restart elsewhere: the tokens so far are given up (counted)
            turns = [rid for rid in self.engine.group_ids() if rid.startswith(f"{gid}#")]
            runner = self._runners.pop(gid, None)
            self.episode_tokens_discarded += sum(self.engine.tokens_so_far(rid) for rid in turns) + (
                runner.tokens_generated if runner is not None else 0)
            for rid in turns:
                self.engine.take(rid)
            if gid in self._jobs:
                self._spawn(self._hand_over(self._jobs.pop(gid), None, reason))
        await asyncio.gather(*self._episodes.values(), return_exceptions=True)
        self._episodes.clear()
        for job in self._waiting:
            self._spawn(self._hand_over(job, None, reason))
        self._waiting = []
        if self._tasks:
            await asyncio.gather(*self._tasks)
        self._tasks.clear()
        await self._commit_dead_letters()


async def run_worker(config: FleetConfig, region: str, node: str, stop: asyncio.Event,
                     engine: Engine | None = None, preempted: asyncio.Event | None = None) -> None:
    """Run one node's rollout worker until `stop` (SIGTERM) or `preempted`; hand over and return."""
    await RolloutWorker(config, region, node, engine=engine).run(stop, preempted)
