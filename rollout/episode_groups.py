"""The worker's groups that run as episodes (rollout/episodes.py), their turns decoded in the shared engine.

A job with an environment runs its samples as episodes in a task of its own. Each model turn is
a one-sample engine request (`<group id>#<sample>` and a turn number): `generate_turn` queues it,
the worker's loop submits queued turns and withdraws those of cancelled episodes between two
steps (`sync_turns`, the engine is not stepping then) and hands a finished turn back (`deliver`),
so turns of many episodes share the continuous batch while environment steps run in their own
thread pool (`env.threads`). A finished group is published by the `GroupPublisher`; one whose
environment failed is dead-lettered. On a handover (`hand_over`) the episodes are cancelled and
the group handed over as a restart (no samples): its episodes begin again elsewhere, and the
tokens given up are counted (`episode_tokens_discarded`).
"""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor

from fleetrl.broker import PartialSample, Sampling, floats, ids
from fleetrl.config import EnvConfig, FleetConfig
from fleetrl.log import get_logger
from fleetrl.rollout.engine import Engine, FinishedGroup, GroupRequest
from fleetrl.rollout.episodes import EpisodeRunner, Generate, TurnTemplate, load_env_factory
from fleetrl.rollout.errors import EngineError, EnvError, TaskError
from fleetrl.rollout.jobs import Job
from fleetrl.rollout.publisher import GroupPublisher
from fleetrl.rollout.scheduling import JobQueue
from fleetrl.rollout.stats import WorkerCounters
from fleetrl.rollout.tokenize import TextCodec

log = get_logger(__name__)


class EpisodeGroups:
    """Episode groups in flight; `generate` is how a runner asks for a turn (normally `generate_turn`)."""

    def __init__(self, config: FleetConfig, engine: Engine, codec: TextCodec, queue: JobQueue,
                 publisher: GroupPublisher, counters: WorkerCounters, generate: Generate) -> None:
        self.config, self.engine, self.codec, self.queue = config, engine, codec, queue
        self.publisher, self.counters, self._generate = publisher, counters, generate
        self.env_cfg = config.dataset.env
        """`dataset.env`, or the first environment a record named in a run without it."""
        self._pool: ThreadPoolExecutor | None = None
        self._tasks: dict[str, asyncio.Task[None]] = {}  # group id -> its episodes' task
        self._runners: dict[str, EpisodeRunner] = {}  # group id -> its episodes' runner
        self._turns: dict[str, asyncio.Future[list[PartialSample]]] = {}  # turn request id -> its result
        self._turn_queue: list[GroupRequest] = []  # turns to submit before the next step
        self._turn_withdraw: list[str] = []  # turns of cancelled episodes to take out before the next step

    def start(self, job: Job) -> None:
        self._tasks[job.group_id] = asyncio.create_task(self._run(job), name=f"episodes-{job.group_id}")

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)  # a hanging tool keeps only its thread

    # -- turns through the engine -----------------------------------------------------------------

    def sync_turns(self) -> None:
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

    def deliver(self, group: FinishedGroup) -> bool:
        """A group back from the engine: True when it is one of these turns (its episode takes it)."""
        turn = self._turns.get(group.group_id)
        if turn is None:
            return False
        if not turn.done():
            turn.set_result(group.samples)
        return True

    async def generate_turn(self, request_id: str, context: list[int], sampling: Sampling) -> PartialSample:
        """One model turn of an episode, decoded by this worker's engine beside everything else."""
        turn: asyncio.Future[list[PartialSample]] = asyncio.get_running_loop().create_future()
        self._turns[request_id] = turn
        self._turn_queue.append(GroupRequest(request_id, context, sampling, 1, seed=self.config.rollout.seed))
        self.queue.arrived.set()
        try:
            return (await turn)[0]
        except asyncio.CancelledError:
            self._turn_withdraw.append(request_id)
            raise
        finally:
            self._turns.pop(request_id, None)

    # -- a group's episodes -----------------------------------------------------------------------

    def _runner(self, job: Job) -> EpisodeRunner:
        cfg = self.env_cfg
        if cfg is None:  # a record that names its own environment in a run without dataset.env
            cfg = self.env_cfg = EnvConfig(name=job.env["name"] if job.env else "")
        if self._pool is None:
            self._pool = ThreadPoolExecutor(cfg.threads, thread_name_prefix="fleetrl-env")
        assert job.env is not None
        budget = cfg.max_episode_tokens or self.config.algorithm.max_new_tokens
        return EpisodeRunner(cfg, load_env_factory(job.env["name"], cfg.python_path), self.codec,
                             TurnTemplate(self.codec, sorted(self.engine.eos_ids)), self._pool,
                             self._generate, budget)

    async def _run(self, job: Job) -> None:
        try:
            runner = self._runners[job.group_id] = self._runner(job)
            results = await runner.run_group(job.group_id, job.prompt, job.prompt_ids,
                                             (job.env or {}).get("args") or {})
        except (EnvError, TaskError) as exc:  # a group whose environment failed: it goes, the worker goes on
            log.warning("worker.env_error", group_id=job.group_id, error=str(exc))
            self.queue.running.pop(job.group_id, None)
            self._runners.pop(job.group_id, None)
            await self.publisher.dead_letter(job.delivery, "env_error", str(exc), "env")
            return
        self.queue.running.pop(job.group_id, None)
        self._runners.pop(job.group_id, None)
        await self.publisher.publish(job, results)

    def surface_errors(self) -> None:
        for gid, task in [(g, t) for g, t in self._tasks.items() if t.done()]:
            del self._tasks[gid]
            if not task.cancelled():
                task.result()

    async def hand_over(self, reason: str) -> None:
        """Cancel every group's episodes and hand the group over unstarted (its episodes restart elsewhere)."""
        for gid, task in list(self._tasks.items()):
            task.cancel()  # the tokens so far are given up (counted)
            turns = [rid for rid in self.engine.group_ids() if rid.startswith(f"{gid}#")]
            runner = self._runners.pop(gid, None)
            self.counters.episode_tokens_discarded += sum(self.engine.tokens_so_far(rid) for rid in turns) + (
                runner.tokens_generated if runner is not None else 0)
            for rid in turns:
                self.engine.take(rid)
            if gid in self.queue.running:
                self.publisher.spawn(self.publisher.hand_over(self.queue.running.pop(gid), None, reason))
        await asyncio.gather(*self._tasks.values(), return_exceptions=True)
        self._tasks.clear()
