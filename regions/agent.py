"""The region agent (DESIGN.md §1, §4, §9): the daemon on one rollout node, around its rollout worker.

    fleetrl agent --config fleet.yaml --region R --node N

The agent runs the node's `RolloutWorker` in-process (the worker loop lives in `fleetrl.rollout`; the
agent only starts and stops it) and speaks for the node on the MQTT control plane:

* a retained heartbeat on `fleetrl/<run>/nodes/<region>/<node>` every `mqtt.heartbeat_interval_s` and
  on every state change: `up`, `draining` or `offline`, with the policy version the engine holds,
  tokens/s, groups in flight and the engines; a last will publishes `offline` if the process dies;
* control commands on `fleetrl/<run>/control/<region>`:
  `drain`: stop admitting and hand unfinished groups over as partials (the worker stops and leaves the
  rollout consumer group, so the region's other nodes take its partitions); stay connected as
  `draining`. `resume`: start a fresh worker on the same engine (state `up`). `stop`: hand over, exit 0;
* preemption watchers (`fleetrl.regions.preemption`): SIGTERM/SIGINT, or a notice file, make the agent
  hand over within `rollout.handover_timeout_s`, publish `offline` and exit 0.

State machine (`offline` is only ever the last word):

    up ──drain──▶ draining ──resume──▶ up
    up | draining ──stop / signal / notice──▶ (hand over) ──▶ offline, exit 0

The worker's handover reason is `preempted` for a preemption notice, `drain` or `stop` for those
commands, and `sigterm` for a signal.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Sequence
from typing import Any, Literal

from fleetrl.broker import ControlCommand, ControlPlane, ControlPlaneError, Heartbeat
from fleetrl.config import FleetConfig
from fleetrl.log import get_logger
from fleetrl.regions.errors import AgentError
from fleetrl.regions.identity import check_identity
from fleetrl.regions.metrics import AgentMetrics
from fleetrl.regions.preemption import PreemptionWatcher, SignalWatcher
from fleetrl.rollout import Engine, RolloutWorker, build_engine

log = get_logger(__name__)
State = Literal["up", "draining", "offline"]
_HANDOVER_SLACK_S = 5.0  # beyond the worker's own bounds (intake h/2 + handover h) before we give up on it


class RegionAgent:
    """One node's agent; `await run()` returns the reason it stopped (`sigterm`, `preempted`, `stop`)."""

    def __init__(self, config: FleetConfig, region: str, node: str, *,
                 watchers: Sequence[PreemptionWatcher] | None = None, engine: Engine | None = None) -> None:
        check_identity(config, region, node)
        self.config, self.region, self.node = config, region, node
        self.watchers = list(watchers) if watchers is not None else [SignalWatcher()]
        self.client_id = f"fleetrl-agent-{region}-{node}"
        self.state: State = "up"
        self.worker: RolloutWorker | None = None
        self.exit_reason: str | None = None
        self.workers_started = 0
        self._engine = engine
        self._draining = False
        self._changed = asyncio.Event()  # a command or notice the supervisor must look at
        self._beat_now = asyncio.Event()  # a state change to publish before the next interval
        self._cp: ControlPlane | None = None
        self._retired = (0, 0)  # groups done and handed over by workers that already stopped
        self.metrics = AgentMetrics()
        self.metrics_port: int | None = None

    # -- the daemon -----------------------------------------------------------------------------

    async def run(self) -> str:
        watching = [asyncio.create_task(self._watch(w), name=f"watch-{type(w).__name__}") for w in self.watchers]
        await asyncio.sleep(0)  # let signal watchers take their signals before the slow start-up
        try:
            if self.config.rollout.metrics_port is not None:
                self.metrics_port = self.metrics.serve(self.config.rollout.metrics_port)
                log.info("agent.metrics", region=self.region, node=self.node, port=self.metrics_port)
            async with ControlPlane(self.config, self.client_id, will=(self.region, self.node),
                                    watch_nodes=False) as cp:
                self._cp = cp
                await self._serve(cp)
        finally:
            for task in watching:
                task.cancel()
            await asyncio.gather(*watching, return_exceptions=True)
            for w in self.watchers:
                w.close()
            self.metrics.close()
        log.info("agent.stopped", region=self.region, node=self.node, reason=self.exit_reason)
        return self.exit_reason or "stop"

    async def _serve(self, cp: ControlPlane) -> None:
        beats = asyncio.create_task(self._heartbeats(), name="heartbeats")
        commands = asyncio.create_task(self._commands(cp), name="commands")
        log.info("agent.started", region=self.region, node=self.node, engines=self._engine_names())
        try:
            if self._engine is None:
                self._engine = await asyncio.to_thread(build_engine, self.config, self.region, self.node)
            await self._supervise(commands)
        finally:
            for task in (beats, commands):
                task.cancel()
            await asyncio.gather(beats, commands, return_exceptions=True)
            self._set_state("offline")
            with contextlib.suppress(ControlPlaneError):  # the last will says it anyway
                await self._publish_heartbeat(timeout_s=2.0)

    async def _supervise(self, commands: asyncio.Task[None]) -> None:
        """Run a worker while `up`; stop it on drain or exit; wait while `draining`."""
        while self.exit_reason is None:
            if self._draining:
                await self._until_changed(commands)
            else:
                await self._run_worker(commands)

    async def _run_worker(self, commands: asyncio.Task[None]) -> None:
        worker = RolloutWorker(self.config, self.region, self.node, engine=self._engine)
        if self.worker is not None:
            done, handed = self._retired
            self._retired = (done + self.worker.groups_done, handed + self.worker.groups_handed_over)
        self.worker, self.workers_started = worker, self.workers_started + 1
        stop, preempted = asyncio.Event(), asyncio.Event()
        task = asyncio.create_task(worker.run(stop, preempted), name="rollout-worker")
        while not task.done() and self.exit_reason is None and not self._draining:
            await self._until_changed(commands, task)
        if task.done():
            task.result()  # a worker that died surfaces why; the agent exits non-zero
            if self.exit_reason is None and not self._draining:
                raise AgentError(f"rollout worker of {self.region}/{self.node} stopped on its own")
            return
        reason = self.exit_reason or "drain"
        worker.stop_reason = reason if reason in ("drain", "stop") else "sigterm"
        (preempted if reason == "preempted" else stop).set()
        bound_s = 1.5 * self.config.rollout.handover_timeout_s + _HANDOVER_SLACK_S
        log.info("agent.handing_over", region=self.region, node=self.node, reason=reason, bound_s=bound_s)
        try:
            await asyncio.wait_for(task, timeout=bound_s)
        except TimeoutError:
            log.error("agent.handover_timeout", region=self.region, node=self.node, bound_s=bound_s)

    async def _until_changed(self, commands: asyncio.Task[None], *others: asyncio.Task[None]) -> None:
        """Wait for a command or notice (or for a watched task to end); a dead command stream is fatal."""
        self._changed.clear()
        changed = asyncio.ensure_future(self._changed.wait())
        try:
            await asyncio.wait({changed, commands, *others}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            changed.cancel()
        if commands.done():
            commands.result()
            raise AgentError(f"control commands of region {self.region} stopped arriving")

    # -- inputs: notices and commands -----------------------------------------------------------

    async def _watch(self, watcher: PreemptionWatcher) -> None:
        notice = await watcher.wait()
        log.info("agent.notice", region=self.region, node=self.node, reason=notice.reason, detail=notice.detail)
        self._request_exit(notice.reason)

    async def _commands(self, cp: ControlPlane) -> None:
        async for command in cp.commands(self.region):
            self.on_command(command)

    def on_command(self, command: ControlCommand) -> None:
        log.info("agent.command", region=self.region, node=self.node, cmd=command.cmd, reason=command.reason,
                 state=self.state)
        if command.cmd == "stop":
            self._request_exit("stop")
        elif self.exit_reason is not None:
            return  # leaving already: a drain or resume changes nothing
        elif command.cmd == "drain" and not self._draining:
            self._draining = True
            self._set_state("draining")
        elif command.cmd == "resume" and self._draining:
            self._draining = False
            self._set_state("up")

    def _request_exit(self, reason: str) -> None:
        if self.exit_reason is None:
            self.exit_reason = reason
            self._set_state("draining")  # handing over; `offline` once done
        self._changed.set()

    # -- heartbeats -----------------------------------------------------------------------------

    def _set_state(self, state: State) -> None:
        if state != self.state:
            log.info("agent.state", region=self.region, node=self.node, state=state, previous=self.state)
            self.state = state
            self._beat_now.set()
        self._changed.set()

    def heartbeat(self) -> Heartbeat:
        """The node's state as the control plane shows it."""
        w = self.worker
        stats: dict[str, Any] = w.stats() if w is not None else {}
        return Heartbeat(state=self.state, version=w.weights.have if w is not None else None,
                         tokens_per_s=stats.get("tokens_per_s", 0.0) if self.state == "up" else 0.0,
                         in_flight=stats.get("groups_in_flight", 0), engines=self._engine_names())

    async def _heartbeats(self) -> None:
        interval_s = self.config.mqtt.heartbeat_interval_s
        while True:
            self._beat_now.clear()
            try:
                await self._publish_heartbeat()
            except ControlPlaneError as exc:  # the client reconnects by itself; the next beat may land
                log.warning("agent.heartbeat_failed", region=self.region, node=self.node, error=str(exc))
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._beat_now.wait(), timeout=interval_s)

    async def _publish_heartbeat(self, timeout_s: float | None = None) -> None:
        beat = self.heartbeat()
        self._refresh_metrics(beat)
        if self._cp is not None:
            await self._cp.heartbeat(self.region, self.node, beat, timeout_s=timeout_s)

    def _refresh_metrics(self, beat: Heartbeat) -> None:
        w = self.worker
        done, handed = self._retired
        if w is not None:
            done, handed = done + w.groups_done, handed + w.groups_handed_over
        self.metrics.update(beat.state, beat.version, w.stats() if w is not None else {}, done, handed,
                            self.workers_started)

    def _engine_names(self) -> list[str]:
        r = self.config.region(self.region)
        cfg = next((n.engine for n in r.nodes if n.name == self.node and n.engine is not None), r.engine)
        return [cfg.kind]
