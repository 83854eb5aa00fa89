"""The worker's effects: each job ends as one record produced, then its offset committed (DESIGN.md §3).

A finished group is scored with the task's reward and produced to `trajectories` (`finish`, or
`publish` for a group of episodes, scored by its environment); an unfinished one is handed over to
`partials` (`hand_over`); a record the worker cannot work goes to `dead-letter` (`dead_letter`).
Only then is the delivery marked done in the `Committer`, which commits in offset order: a worker
killed at any point leaves what it had not produced to the next member of the group.

Effects run as background tasks (`spawn`) beside the engine's loop; `surface_errors` raises the
exception of one that failed beyond its retries (the worker stops, nothing more committed), and
`settle` waits for every one still in flight (the handover's last step).
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any

from fleetrl.broker import Delivery, GroupRecord, PartialSample, Producer, RecordError, encode_record
from fleetrl.crashpoints import crash_point
from fleetrl.log import get_logger
from fleetrl.rollout.commits import Committer
from fleetrl.rollout.engine import FinishedGroup
from fleetrl.rollout.episodes import EpisodeResult
from fleetrl.rollout.errors import RewardError, TaskError
from fleetrl.rollout.jobs import Job, group_record, partial_record, reward_input
from fleetrl.rollout.region_history import RegionHistory
from fleetrl.rollout.rewards import Rewards
from fleetrl.rollout.stats import WorkerCounters
from fleetrl.rollout.tokenize import TextCodec

log = get_logger(__name__)


class GroupPublisher:
    """Produces each job's record and commits its delivery. `producer` is set when the worker opens it."""

    producer: Producer

    def __init__(self, region: str, node: str, rewards: Rewards, codec: TextCodec, commits: Committer,
                 counters: WorkerCounters, region_history: RegionHistory | None) -> None:
        self.region, self.node, self.rewards, self.codec = region, node, rewards, codec
        self.commits, self.counters, self.region_history = commits, counters, region_history
        self._tasks: set[asyncio.Task[None]] = set()

    # -- effects in the background ----------------------------------------------------------------

    def spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        self._tasks.add(asyncio.create_task(coro))

    def surface_errors(self) -> None:
        for task in [t for t in self._tasks if t.done()]:
            self._tasks.discard(task)
            task.result()  # an effect that failed beyond its retries stops the worker (nothing committed)

    async def settle(self) -> None:
        """Wait for every effect in flight (their records land, their offsets are marked done)."""
        if self._tasks:
            await asyncio.gather(*self._tasks)
        self._tasks.clear()

    # -- the records ------------------------------------------------------------------------------

    async def finish(self, job: Job, group: FinishedGroup, rewards: Rewards | None = None) -> None:
        """Score a finished group with the task's reward (`rewards`: an eval set's own) and produce it to
        `trajectories`."""
        try:
            scores = await (rewards or self.rewards).score(job.prompt.task,
                                                           reward_input(job, group.samples, self.codec))
        except RewardError as exc:  # the user's reward failed on this group: it goes, the worker goes on
            log.warning("worker.reward_error", group_id=job.group_id, error=str(exc))
            await self.dead_letter(job.delivery, "reward_error", str(exc), "reward")
            return
        except TaskError as exc:
            await self.dead_letter(job.delivery, "reward", str(exc), "reference")
            return
        record = group_record(job, group.samples, scores.rewards, self.region, self.node, scores.parts)
        await self._produce(record)
        self.counters.tokens_generated += sum(len(s.completion_ids) for s in group.samples)
        log.info("worker.group_done", group_id=group.group_id, reward=round(
            sum(s.reward for s in record.samples) / len(record.samples), 4))
        await self.mark_done(job.delivery)

    async def publish(self, job: Job, results: list[EpisodeResult]) -> None:
        """Produce a group of episodes, scored by their environment (`fleetrl.group/2`)."""
        for r in results:
            if r.error is not None:
                self.counters.episodes_failed += 1
                log.warning("worker.episode_failed", group_id=job.group_id, error=r.error)
        replayed = {"calls_replayed": sum(r.calls_replayed for r in results),
                    "tokens_replayed": sum(r.tokens_replayed for r in results),
                    "tokens_regenerated": sum(r.tokens_regenerated for r in results)}
        # A handed-over capture's tokens not replayed are waste of the region that sampled them (the trainer's
        # cost report counts them from the record, docs/cost.md).
        lost_by = getattr(getattr(job.delivery.record, "handed_over_by", None), "region", self.region)
        record = group_record(job, [r.sample for r in results], [r.reward for r in results], self.region,
                              self.node, sources=[r.segments for r in results],
                              contexts=[r.contexts for r in results])
        record.regenerated = {lost_by: replayed["tokens_regenerated"]} if replayed["tokens_regenerated"] else None
        segments = [len(r.contexts) for r in results if r.contexts is not None]
        self.counters.agent_samples += len(segments)
        self.counters.agent_samples_resegmented += sum(1 for n in segments if n > 1)
        self.counters.agent_calls_replayed += replayed["calls_replayed"]
        self.counters.agent_tokens_replayed += replayed["tokens_replayed"]
        self.counters.agent_tokens_regenerated += replayed["tokens_regenerated"]
        await self._produce(record)
        self.counters.tokens_generated += sum(int((r.sample.versions >= 0).sum()) for r in results)
        log.info("worker.group_done", group_id=job.group_id, episodes=len(results),
                 turns=sum(r.turns for r in results), **({"segments": segments} if segments else {}),
                 **(replayed if job.resume is not None and any(replayed.values()) else {}),
                 reward=round(sum(r.reward for r in results) / len(results), 4))
        await self.mark_done(job.delivery)

    async def _produce(self, record: GroupRecord) -> None:
        if self.region_history is not None:  # it skips the group when it comes back (the engine has it)
            self.region_history.mine(record.group_id, record.attempt)
        await self.producer.send("trajectories", record.group_id, record)
        crash_point("rollout.group.produced")
        self.counters.groups_done += 1

    async def hand_over(self, job: Job, samples: list[PartialSample] | None, reason: str) -> None:
        """Produce an unfinished group to `partials`, its samples as far as they got here (None: unstarted)."""
        record = partial_record(job, samples, self.region, self.node, reason)
        await self.producer.send("partials", job.group_id, record)
        crash_point("rollout.partial.produced")
        self.counters.groups_handed_over += 1
        self.counters.handed_over_by_reason[reason] += 1
        log.info("worker.handed_over", group_id=job.group_id, reason=reason,
                 tokens=sum(len(s.completion_ids) for s in record.samples))
        await self.mark_done(job.delivery)

    async def dead_letter(self, d: Delivery, reason: str, message: str, field: str) -> None:
        """Send the delivery's record to `dead-letter` with `reason`, then count its offset done."""
        group_id = getattr(d.record, "group_id", None)
        err = RecordError(reason, message, field=field, group_id=group_id).at(d.topic, d.partition, d.offset)
        await self.producer.dead_letter(d.key.encode() if d.key else None, encode_record(d.record), err,
                                        d.topic, d.partition, d.offset)
        await self.mark_done(d)

    async def mark_done(self, d: Delivery) -> None:
        await self.commits.done(d)
