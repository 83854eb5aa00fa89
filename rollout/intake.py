"""The worker's Kafka intake: deliveries of `partials` and `prompts` become admitted jobs (DESIGN.md §3).

`Intake.run` polls the region's rollout consumer group (partials first) beside the engine, as
many records as the `JobQueue` has room for; with no room it skims, so hostile records at the head
of a partition are dead-lettered at once rather than wait in front of the good prompts. Each
delivery taken on is owed an effect in the `Committer`'s queue; one the worker cannot work
(a chat prompt that does not render, a prompt over `dataset.max_prompt_tokens`) is dead-lettered,
and one it already holds (a re-delivery after a rebalance, a redispatched group) is not worked
twice. After a rebalance `on_assigned` gives up the waiting jobs of partitions that moved.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

from fleetrl.broker import Consumer, Delivery
from fleetrl.config import EnvConfig, FleetConfig
from fleetrl.log import get_logger
from fleetrl.rollout.commits import Committer
from fleetrl.rollout.errors import TaskError
from fleetrl.rollout.eval_lane import EvalLane
from fleetrl.rollout.jobs import Job
from fleetrl.rollout.publisher import GroupPublisher
from fleetrl.rollout.scheduling import JobQueue
from fleetrl.rollout.stats import WorkerCounters
from fleetrl.rollout.tokenize import TextCodec

log = get_logger(__name__)
IDLE_WAKE_S = 0.05  # an idle loop's longest nap: bounds how late it sees a stop or new weights


class Intake:
    """Polls while `admitting`; `consumer` is set when the worker opens it. `env_cfg` gives the
    environment a job runs in when its record names none (`dataset.env`, read at each admission)."""

    consumer: Consumer

    def __init__(self, config: FleetConfig, codec: TextCodec, queue: JobQueue, publisher: GroupPublisher,
                 commits: Committer, counters: WorkerCounters, env_cfg: Callable[[], EnvConfig | None]) -> None:
        self.config, self.cfg, self.codec, self.queue = config, config.rollout, codec, queue
        self.publisher, self.commits, self.counters, self._env_cfg = publisher, commits, counters, env_cfg
        self.admitting = True
        self.polling = False  # inside a poll
        self.eval_lane: EvalLane | None = None
        """Where eval prompts go (rollout/eval_lane.py); the worker sets it."""

    async def run(self) -> None:
        """Poll Kafka beside the engine (a poll costs round trips) whenever a group slot is free."""
        next_skim = 0.0
        while self.admitting:
            dead_before = self.consumer.dead_count
            free = self.queue.free()
            if free <= 0:
                # No room for a group, but hostile records at the head of the partitions need none:
                # dead-letter them now rather than let a flood wait in front of the good prompts.
                if time.monotonic() >= next_skim:
                    next_skim = time.monotonic() + self.cfg.idle_poll_s
                    await self.consumer.skim()
                await asyncio.sleep(IDLE_WAKE_S)
            else:
                self.polling = True
                try:
                    deliveries = await self.consumer.poll(free, self.cfg.idle_poll_s)
                finally:
                    self.polling = False
                for d in deliveries:
                    self.take_on(d)
            if self.consumer.dead_count > dead_before:
                await self.commits.past_dead_letters()

    def take_on(self, d: Delivery) -> None:
        commits, publisher = self.commits.queue, self.publisher
        if commits.owes(d):
            # The same record again (a rebalance reset the position to the committed offset): the delivery
            # taken on first still owes its effect; marking this one done would commit it early.
            self.counters.redelivered += 1
            log.info("worker.redelivered", stream=d.stream, partition=d.partition, offset=d.offset)
            return
        commits.owe(d)
        if commits.handed_out(d):  # its group was produced; the commit was lost to a rebalance
            self.counters.redelivered += 1
            log.info("worker.redelivered", stream=d.stream, partition=d.partition, offset=d.offset, produced=True)
            publisher.spawn(publisher.mark_done(d))
            return
        try:
            job = Job.from_delivery(d, self.codec)
        except TaskError as exc:  # a chat prompt the tokenizer cannot render
            publisher.spawn(publisher.dead_letter(d, "render_error", str(exc), "messages"))
            return
        limit = self.config.dataset.max_prompt_tokens
        if len(job.prompt_ids) > limit:
            publisher.spawn(publisher.dead_letter(d, "tokens_bound", f"rendered prompt of {len(job.prompt_ids)} "
                                                  f"tokens > {limit} (dataset.max_prompt_tokens)", "messages"))
            return
        if self.queue.holds(job.group_id) or (self.eval_lane is not None and self.eval_lane.holds(job.group_id)):
            # A second delivery of a group already here (a redispatch): the first one's record serves.
            log.info("worker.duplicate_delivery", group_id=job.group_id, offset=d.offset)
            publisher.spawn(publisher.mark_done(d))
            return
        if job.prompt.eval is not None and self.eval_lane is not None:
            log.info("worker.admitted", group_id=job.group_id, stream=d.stream, offset=d.offset, eval=True)
            self.eval_lane.admit(job)
            return
        job.resolve_env(self._env_cfg())
        log.info("worker.admitted", group_id=job.group_id, stream=d.stream, offset=d.offset)
        self.queue.admit(job)

    def on_assigned(self, owned: set[tuple[str, int]]) -> None:
        """After a rebalance: give up the admitted groups not yet started whose partition went to another
        member (it reads them again from the committed offset; starting them here would generate them
        twice). Groups already decoding stay: their effect may still arrive first."""
        started = {(job.delivery.tp, job.delivery.offset) for job in self.queue.running.values()}
        gone = self.commits.queue.forget(lambda d: d.tp in owned or (d.tp, d.offset) in started)
        released = {(d.tp, d.offset) for d in gone}
        if not released:
            return
        group_ids = self.queue.release(released)
        log.info("worker.released", groups=len(group_ids), group_ids=group_ids, offsets=len(released))

    async def stop(self, task: asyncio.Task[None], reason: str, handover_timeout_s: float) -> None:
        """After `admitting` is cleared: let a poll in progress finish (its records join the handover);
        cancel one that hangs.

        On a preemption a poll is cancelled at once: its records would only be handed over unstarted,
        and uncommitted they are read again by their partition's next owner; a poll held by a rebalance
        (a spot region's group changes members every few seconds) kept the going node, paid, and its
        partials waiting, for up to half the handover bound."""
        if reason == "preempted" and self.polling:
            task.cancel()
            await asyncio.wait([task], timeout=self.config.kafka.request_timeout_s)
            self.counters.polls_cancelled += 1
            log.info("worker.poll_cancelled", reason=reason)
            return
        try:
            await asyncio.wait_for(task, timeout=handover_timeout_s / 2)
        except TimeoutError:
            log.warning("worker.intake_cancelled")
