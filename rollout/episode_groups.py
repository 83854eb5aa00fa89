"""The worker's groups that run as episodes (rollout/episodes.py), their turns decoded in the shared engine.

A job with an environment runs its samples as episodes in a task of its own: skyrl-gym episodes
(rollout/episodes.py), or agent runs against the worker's OpenAI-compatible endpoint
(`kind: openai_agent`, rollout/agent_episodes.py; the endpoint starts with the first such group), or
verifiers environments' episodes against the same endpoint (`kind: verifiers`, rollout/verifiers_env.py).
Each model turn is a one-sample engine request (`<group id>#<sample>` and a turn number): `generate_turn` queues it,
the worker's loop submits queued turns and withdraws those of cancelled episodes between two
steps (`sync_turns`, the engine is not stepping then) and hands a finished turn back (`deliver`),
so turns of many episodes share the continuous batch while environment steps run in their own
thread pool (`env.threads`). A finished group is published by the `GroupPublisher`; one whose
environment failed is dead-lettered. On a handover (`hand_over`) the episodes are cancelled and
the group handed over: skyrl-gym episodes as a restart (no samples), their episodes begin again
elsewhere and the tokens given up are counted (`episode_tokens_discarded`). An agent's own state (its
Python objects) cannot travel either, but its captured calls do: an agent group leaves as a
`fleetrl.partial/2` of each run's completed calls, and the receiving worker restarts each run with
those calls answered from the capture (rollout/agent_replay.py); only a call still decoding is given up.
"""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

from fleetrl.broker import PartialSample, Sampling
from fleetrl.config import EnvConfig, FleetConfig
from fleetrl.log import get_logger
from fleetrl.rollout.engine import Engine, FinishedGroup
from fleetrl.rollout.episodes import EpisodeRunner, Generate, TurnTemplate, load_env_factory
from fleetrl.rollout.errors import EnvError, TaskError
from fleetrl.rollout.jobs import Job
from fleetrl.rollout.publisher import GroupPublisher
from fleetrl.rollout.scheduling import JobQueue
from fleetrl.rollout.stats import WorkerCounters
from fleetrl.rollout.tokenize import TextCodec
from fleetrl.rollout.turns import EngineTurns

if TYPE_CHECKING:
    from fleetrl.rollout.openai_server import EndpointServer

log = get_logger(__name__)
Runner = Any
"""An `EpisodeRunner` (skyrl-gym), an `AgentRunner` (rollout/agent_episodes.py) or a `VerifiersRunner`
(rollout/verifiers_env.py): `run_group`, `tokens_generated`."""


class EpisodeGroups:
    """Episode groups in flight; `generate` is how a runner asks for a turn (normally `generate_turn`)."""

    def __init__(self, config: FleetConfig, engine: Engine, codec: TextCodec, queue: JobQueue,
                 publisher: GroupPublisher, counters: WorkerCounters, generate: Generate) -> None:
        self.config, self.engine, self.codec, self.queue = config, engine, codec, queue
        self.publisher, self.counters, self._generate = publisher, counters, generate
        self.env_cfg = config.dataset.env
        """`dataset.env`: the environment of records that name none (a record's own never becomes it)."""
        self.turns = EngineTurns(engine, config.rollout.seed, queue.arrived.set)
        self._pool: ThreadPoolExecutor | None = None
        self._endpoint: EndpointServer | None = None  # the agent endpoint, started by the first agent group
        self._verifiers_env: Any = None  # `kind: verifiers`: the environment, loaded by the first group
        self._tasks: dict[str, asyncio.Task[None]] = {}  # group id -> its episodes' task
        self._runners: dict[str, Runner] = {}  # group id -> its episodes' runner

    def start(self, job: Job) -> None:
        self._tasks[job.group_id] = asyncio.create_task(self._run(job), name=f"episodes-{job.group_id}")

    async def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)  # a hanging tool keeps only its thread
        if self._endpoint is not None:  # its server and the agents' HTTP clients (their sockets) close, bounded
            await self._endpoint.stop()

    # -- turns through the engine -----------------------------------------------------------------

    def sync_turns(self) -> None:
        """Between steps (the engine is not stepping): withdraw cancelled turns, submit new ones."""
        self.turns.sync()

    def deliver(self, group: FinishedGroup) -> bool:
        """A group back from the engine: True when it is one of these turns (its episode takes it)."""
        return self.turns.deliver(group)

    async def generate_turn(self, request_id: str, context: list[int], sampling: Sampling) -> PartialSample:
        """One model turn of an episode, decoded by this worker's engine beside everything else."""
        return (await self.turns.generate(request_id, context, sampling))[0]

    # -- a group's episodes -----------------------------------------------------------------------

    async def _runner(self, job: Job) -> Runner:
        # A record that names its own environment in a run without `dataset.env` runs with the defaults;
        # it never becomes the environment of later records that name none.
        cfg = self.env_cfg if self.env_cfg is not None else EnvConfig(name=job.env["name"] if job.env else "")
        assert job.env is not None
        budget = cfg.max_episode_tokens or self.config.algorithm.max_new_tokens
        if cfg.kind == "openai_agent":
            from fleetrl.rollout.agent_episodes import AgentRunner, load_agent

            server = await self._agent_endpoint(cfg)
            return AgentRunner(cfg, load_agent(job.env["name"], cfg.python_path), server, self.publisher.rewards,
                               budget, resume=job.resume)
        if cfg.kind == "verifiers":
            from fleetrl.rollout.verifiers_env import VerifiersRunner, load_verifiers_env

            if self._verifiers_env is None:  # loaded once: a taskset may read its data when it is built
                self._verifiers_env = load_verifiers_env(cfg)
            return VerifiersRunner(cfg, self._verifiers_env, await self._agent_endpoint(cfg), budget)
        if self._pool is None:
            self._pool = ThreadPoolExecutor(cfg.threads, thread_name_prefix="fleetrl-env")
        return EpisodeRunner(cfg, load_env_factory(job.env["name"], cfg.python_path), self.codec,
                             TurnTemplate(self.codec, sorted(self.engine.eos_ids)), self._pool,
                             self._generate, budget)

    async def _agent_endpoint(self, cfg: EnvConfig) -> EndpointServer:
        """The worker's OpenAI-compatible endpoint over its engine (one per worker, started on first use)."""
        if self._endpoint is None:
            from fleetrl.rollout.openai_server import AgentEndpoint, EndpointServer

            sample_bound = max(self.config.algorithm.max_new_tokens, cfg.max_episode_tokens or 0)
            endpoint = AgentEndpoint(self.codec, sorted(self.engine.eos_ids), self.turns.generate,
                                     max_context=self.engine.max_context,
                                     default_max_tokens=self.config.algorithm.max_new_tokens,
                                     max_record_prompt=self.config.dataset.max_prompt_tokens + sample_bound)
            self._endpoint = await EndpointServer(endpoint, cfg.endpoint_port).start()
        return self._endpoint

    async def _run(self, job: Job) -> None:
        try:
            runner = self._runners[job.group_id] = await self._runner(job)
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
        """Cancel every group's episodes and hand each group over: an agent run's completed calls travel
        (`fleetrl.partial/2`, replayed where the group resumes: rollout/agent_replay.py); other episodes
        restart elsewhere (no samples). Tokens given up are counted (`episode_tokens_discarded`)."""
        runners: dict[str, Runner] = {}
        """Agent groups' runners (`AgentRunner`: their captured calls travel)."""
        for gid, task in list(self._tasks.items()):
            task.cancel()
            turns = [rid for rid in self.engine.group_ids() if rid.startswith(f"{gid}#")]
            runner = self._runners.pop(gid, None)
            kept = hasattr(runner, "handover_samples")  # its captured calls travel; a call still decoding does not
            if kept:
                runners[gid] = runner
            self.counters.episode_tokens_discarded += sum(self.engine.tokens_so_far(rid) for rid in turns) + (
                runner.tokens_generated if runner is not None and not kept else 0)
            for rid in turns:
                self.engine.take(rid)
            self.turns.abort(f"{gid}#")
        if self._tasks:  # each run's capture closes as its task ends; an agent that ignores the cancellation
            # keeps what it had committed and does not hold the other groups' partials past a quarter of the bound
            await asyncio.wait(self._tasks.values(), timeout=self.config.rollout.handover_timeout_s / 4)
        for gid in list(self._tasks):
            job = self.queue.running.pop(gid, None)
            if job is None:
                continue
            runner = runners.get(gid)  # an agent group's runner (None: a restart, it passes on what it came with)
            samples = runner.handover_samples(job.prompt.n_samples) if runner is not None else None
            self.publisher.spawn(self.publisher.hand_over(job, samples, reason))
        self._tasks.clear()
