"""The worker's admitted groups and the engine that decodes them: which job starts, which is cut.

`JobQueue` holds each admitted `Job` from the intake until its record is produced: `waiting` (for
the weights its `min_version` asks for, or for one of `rollout.max_groups_in_flight` decoding
slots, oldest first) and `running` (submitted to the engine, or running as episodes). Between two
engine steps it starts what may start, hands back a job whose version did not come within
`rollout.min_version_wait_s` (`min_version`), and cuts a group that ran past
`rollout.group_deadline_s` (`deadline`); both leave as partials through the `GroupPublisher`.
`step` runs one decoding step in a thread and counts it.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable

from fleetrl.config import RolloutConfig
from fleetrl.log import get_logger
from fleetrl.rollout.engine import Engine, FinishedGroup, GroupRequest
from fleetrl.rollout.jobs import Job
from fleetrl.rollout.publisher import GroupPublisher
from fleetrl.rollout.stats import WorkerCounters

log = get_logger(__name__)


class JobQueue:
    def __init__(self, engine: Engine, cfg: RolloutConfig, publisher: GroupPublisher,
                 counters: WorkerCounters) -> None:
        self.engine, self.cfg, self.publisher, self.counters = engine, cfg, publisher, counters
        self.running: dict[str, Job] = {}  # started, not yet handed to a record
        self.waiting: list[Job] = []  # admitted, waiting for min_version or a decoding slot
        self.have, self.have_since = -1, time.monotonic()  # newest version here, since when
        self.arrived = asyncio.Event()
        """Set when work arrives for the engine (a job admitted, an episode's turn queued)."""

    def __len__(self) -> int:
        return len(self.running) + len(self.waiting)

    def free(self) -> int:
        """Room for more jobs: up to `max_groups_in_flight` decode, and as many more may wait here for
        their weights (prompts the trainer sent ahead: they start the moment the version lands)."""
        return 2 * self.cfg.max_groups_in_flight - len(self)

    def holds(self, group_id: str) -> bool:
        return group_id in self.running or any(w.group_id == group_id for w in self.waiting)

    def admit(self, job: Job) -> None:
        self.waiting.append(job)
        self.arrived.set()

    def release(self, offsets: set[tuple[tuple[str, int], int]]) -> list[str]:
        """Drop the waiting jobs of these (partition, offset)s (they went to another member); their group ids."""
        gone = [job for job in self.waiting if (job.delivery.tp, job.delivery.offset) in offsets]
        self.waiting = [job for job in self.waiting if (job.delivery.tp, job.delivery.offset) not in offsets]
        return [job.group_id for job in gone]

    def start_ready(self, start_episodes: Callable[[Job], None]) -> None:
        """Submit jobs whose min_version the engine has (or has staged), oldest first while a decoding
        slot is free (a job with an environment to `start_episodes`); hand back those that waited too
        long: `min_version_wait_s` with no new version landing here (a prompt sent ahead waits for a
        step or more while versions keep coming)."""
        have = max(self.engine.version, self.engine.staged_version or -1)
        now = time.monotonic()
        if have != self.have:
            self.have, self.have_since = have, now
        still: list[Job] = []
        for job in self.waiting:
            if job.prompt.min_version <= have:
                if len(self.running) < self.cfg.max_groups_in_flight:
                    self._submit(job, start_episodes)
                else:
                    still.append(job)
            elif now - max(job.received_mono, self.have_since) > self.cfg.min_version_wait_s:
                log.info("worker.min_version_timeout", group_id=job.group_id, min_version=job.prompt.min_version,
                         have=have)
                self.publisher.spawn(self.publisher.hand_over(job, None, "min_version"))
            else:
                still.append(job)
        self.waiting = still

    def _submit(self, job: Job, start_episodes: Callable[[Job], None]) -> None:
        p = job.prompt
        job.start()
        self.running[job.group_id] = job
        if job.env is not None:
            start_episodes(job)
            return
        self.engine.submit(GroupRequest(p.group_id, job.prompt_ids, p.sampling, p.n_samples,
                                        seed=self.cfg.seed, resume=job.resume))

    def has_work(self) -> bool:
        return self.engine.has_work() or self.engine.has_staged()

    async def step(self) -> list[FinishedGroup]:
        """One decoding step (and any staged weights applied) in the engine's thread."""
        t0 = time.monotonic()
        finished = await asyncio.to_thread(self.engine.step)
        self.counters.engine_steps += 1
        self.counters.engine_busy_s += time.monotonic() - t0
        return finished

    def finish(self, group: FinishedGroup) -> None:
        """A group came back from the engine: score and publish it in the background."""
        self.publisher.spawn(self._finish(group))

    async def _finish(self, group: FinishedGroup) -> None:
        await self.publisher.finish(self.running.pop(group.group_id), group)

    def cut_long_tail(self) -> None:
        now = time.monotonic()
        for gid, job in list(self.running.items()):
            if job.started_mono is not None and now - job.started_mono > self.cfg.group_deadline_s \
                    and gid in self.engine.group_ids():
                samples = self.engine.take(gid)
                log.info("worker.deadline_cut", group_id=gid, tokens=sum(len(s.completion_ids) for s in samples))
                self.publisher.spawn(self.publisher.hand_over(self.running.pop(gid), samples, "deadline"))

    async def idle(self, wake_s: float) -> None:
        """Nothing to decode: wait for new work, or `wake_s` at most (to see a stop or a version arrive)."""
        self.arrived.clear()
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(wake_s):
                await self.arrived.wait()
