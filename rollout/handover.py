"""The worker's handover on stop: every unfinished group leaves as a `fleetrl.partial/1` (DESIGN.md §3).

Once the worker stops admitting (`sigterm`, `preempted`, or the agent's `drain` / `stop`), each
group still decoding is taken out of the engine with its tokens so far, each group of episodes is
cancelled and handed over (a restart; an agent group with its runs' completed calls, rollout/agent_replay.py),
and each job still waiting is handed over as it came; then
the records in flight land and their offsets, and those past dead letters, are committed. All of
it within `handover_timeout_s`: past it the worker gives up, and what it had not committed is read
again by the partitions' next owners (at-least-once).
"""

from __future__ import annotations

import asyncio

from fleetrl.log import get_logger
from fleetrl.rollout.commits import Committer
from fleetrl.rollout.episode_groups import EpisodeGroups
from fleetrl.rollout.eval_lane import EvalLane
from fleetrl.rollout.publisher import GroupPublisher
from fleetrl.rollout.scheduling import JobQueue

log = get_logger(__name__)


class Handover:
    def __init__(self, queue: JobQueue, episodes: EpisodeGroups, publisher: GroupPublisher,
                 commits: Committer, eval_lane: EvalLane | None = None) -> None:
        self.queue, self.episodes, self.publisher, self.commits = queue, episodes, publisher, commits
        self.eval_lane = eval_lane

    async def bounded(self, reason: str, timeout_s: float) -> bool:
        """Hand everything over within `timeout_s`; False (logged) when it ran out."""
        try:
            await asyncio.wait_for(self.run(reason), timeout=timeout_s)
        except TimeoutError:
            log.error("worker.handover_timeout", timeout_s=timeout_s, uncommitted=self.commits.queue.outstanding())
            return False
        return True

    async def run(self, reason: str) -> None:
        """Publish every unfinished group as a partial, let in-flight records land, commit."""
        queue, publisher, engine = self.queue, self.publisher, self.queue.engine
        for gid in list(queue.running):
            if gid in engine.group_ids():
                publisher.spawn(publisher.hand_over(queue.running.pop(gid), engine.take(gid), reason))
        await self.episodes.hand_over(reason)
        for job in queue.waiting:
            publisher.spawn(publisher.hand_over(job, None, reason))
        queue.waiting = []
        if self.eval_lane is not None:
            self.eval_lane.hand_over(reason)
        await publisher.settle()
        await self.commits.past_dead_letters()
