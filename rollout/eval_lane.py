"""The worker's eval lane: eval prompts generated with exactly their pinned version (DESIGN.md §12).

An eval prompt (`fleetrl.prompt/2` with `eval: {set, version}`) arrives on the same `prompts` topic as
training work; the intake hands it here instead of to the `JobQueue`. The lane owns a second engine
of the node's kind, built on the first eval prompt, that never follows the training weights: before it
starts a batch it materializes the batch's pinned version from the region's hub store (in place over
the version it held, so along a delta chain only the chain is read) and stages it, so every token of
every sample carries exactly that version, however many versions the trainer publishes meanwhile.
The price is a second copy of the weights in the node's memory (docs/eval.md).

The lane waits until the region store holds the version (the worker's own weights reached it, or the
region's replica announcement named it); prompts of one version are batched together in the lane's
engine, which steps in its own thread beside the training engine. A finished group is scored by its
set's reward (`eval.sets[].reward`, default the run's own) and produced to `trajectories` marked eval;
its delivery is committed as any other. On stop the lane hands its groups over as partials (their
tokens so far, all of the pinned version), which another worker's lane resumes.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable
from typing import Any

from fleetrl.config import FleetConfig
from fleetrl.hub import Hub, HubError
from fleetrl.log import get_logger
from fleetrl.rollout.engine import Engine, FinishedGroup, GroupRequest
from fleetrl.rollout.jobs import Job
from fleetrl.rollout.publisher import GroupPublisher
from fleetrl.rollout.rewards import Rewards, build_rewards
from fleetrl.rollout.tasks import get_task

log = get_logger(__name__)
_WAIT_S = 0.2  # how often a lane waiting for its version to reach the region store looks again


class EvalLane:
    def __init__(self, config: FleetConfig, publisher: GroupPublisher, make_engine: Callable[[], Engine],
                 hub: Hub, held: Callable[[], int | None], max_groups: int, seed: int = 0) -> None:
        self.config, self.publisher, self._make_engine, self.hub = config, publisher, make_engine, hub
        self._held, self.max_groups, self.seed = held, max_groups, seed
        self.engine: Engine | None = None
        self.version: int | None = None
        """The version the lane's engine holds (None: none loaded yet)."""
        self._state: dict[str, Any] | None = None
        self.waiting: list[Job] = []
        self.running: dict[str, Job] = {}
        self._wake = asyncio.Event()
        self._rewards: dict[str, Rewards] = {}
        self.groups_done = 0
        self._stopping = False

    def __len__(self) -> int:
        return len(self.waiting) + len(self.running)

    def holds(self, group_id: str) -> bool:
        return group_id in self.running or any(j.group_id == group_id for j in self.waiting)

    def admit(self, job: Job) -> None:
        assert job.prompt.eval is not None
        self.waiting.append(job)
        self._wake.set()

    async def run(self) -> None:
        """Background task: load each batch's pinned version, decode, publish; until `stop`."""
        while not self._stopping:
            if not self.running:
                if not self.waiting:
                    self._wake.clear()
                    with contextlib.suppress(TimeoutError):
                        async with asyncio.timeout(1.0):
                            await self._wake.wait()
                    continue
                if not await self._start_batch():
                    await asyncio.sleep(_WAIT_S)
                    continue
            assert self.engine is not None
            for group in await asyncio.to_thread(self.engine.step):
                job = self.running.pop(group.group_id)
                self.publisher.spawn(self._finish(job, group))

    async def _start_batch(self) -> bool:
        """Start the waiting jobs of the oldest one's version, once its weights are in the engine."""
        version = self._pinned(self.waiting[0])
        held = self._held()
        if held is None or version > held:
            return False  # the region store does not hold it yet
        if self.version != version:
            try:
                await asyncio.to_thread(self._load, version)
            except HubError as exc:
                log.warning("eval.version_unavailable", version=version, error=str(exc), retriable=exc.retriable)
                if not exc.retriable:
                    await self._give_up(version, str(exc))
                return False
        batch = [j for j in self.waiting if self._pinned(j) == version][: self.max_groups]
        self.waiting = [j for j in self.waiting if j not in batch]
        assert self.engine is not None
        for job in batch:
            p = job.prompt
            job.start()
            self.running[job.group_id] = job
            self.engine.submit(GroupRequest(p.group_id, job.prompt_ids, p.sampling, p.n_samples, seed=self.seed,
                                            resume=job.resume))
        return True

    def _load(self, version: int) -> None:
        """Materialize `version` and stage it on the lane's engine (a thread): it applies before the next
        step, so the batch started now decodes only with it."""
        started = time.monotonic()
        if self.engine is None:
            self.engine = self._make_engine()
        self._state = self.hub.materialize(version, into=self._state, have_version=self.version)
        self.engine.stage_weights({k: v.clone() for k, v in self._state.items()}, version)
        log.info("eval.version_loaded", version=version, previous=self.version,
                 seconds=round(time.monotonic() - started, 3))
        self.version = version

    async def _give_up(self, version: int, why: str) -> None:
        """The store no longer holds the version (retention): its prompts cannot be answered as asked."""
        for job in [j for j in self.waiting if self._pinned(j) == version]:
            self.waiting.remove(job)
            self.publisher.spawn(self.publisher.dead_letter(job.delivery, "eval_version_gone", why, "eval.version"))

    async def _finish(self, job: Job, group: FinishedGroup) -> None:
        assert job.prompt.eval is not None
        await self.publisher.finish(job, group, self._rewards_of(job.prompt.eval.set_name))
        self.groups_done += 1

    def _rewards_of(self, set_name: str) -> Rewards:
        if set_name not in self._rewards:
            own = next((s.reward for s in self.config.eval.sets if s.name == set_name), None)
            self._rewards[set_name] = build_rewards(own or self.config.reward, get_task)
        return self._rewards[set_name]

    @staticmethod
    def _pinned(job: Job) -> int:
        assert job.prompt.eval is not None
        return job.prompt.eval.version

    async def stop(self, task: asyncio.Task[None], timeout_s: float) -> None:
        """End `run` after the step in progress (its thread owns the engine until then), bounded."""
        self._stopping = True
        self._wake.set()
        done, _ = await asyncio.wait([task], timeout=timeout_s)
        if not done:
            task.cancel()
            log.warning("eval.lane_stop_timeout", timeout_s=timeout_s)
        elif not task.cancelled() and task.exception() is not None:
            log.error("eval.lane_failed", error=repr(task.exception()))

    def hand_over(self, reason: str) -> None:
        """Hand every eval group over as a partial: decoding ones with their tokens so far (all of the
        pinned version), waiting ones as they came."""
        for gid, job in list(self.running.items()):
            samples = self.engine.take(gid) if self.engine is not None and gid in self.engine.group_ids() else None
            self.publisher.spawn(self.publisher.hand_over(job, samples, reason))
        self.running = {}
        for job in self.waiting:
            self.publisher.spawn(self.publisher.hand_over(job, None, reason))
        self.waiting = []

    def close(self) -> None:
        if self.engine is not None:
            self.engine.close()
