"""The region agent (DESIGN.md §1, §4, §9): the daemon on one rollout node.

    fleetrl agent --config fleet.yaml --region R --node N

The agent runs the node's rollout workers as child processes, one per engine (`engine.devices`; one
on CPU), each under an `EngineSupervisor` that restarts it when it crashes or hangs and reports
`crashloop` when it keeps failing (`fleetrl.regions.supervisor`). It speaks for the node on the MQTT
control plane:

* a retained heartbeat on `fleetrl/<run>/nodes/<region>/<node>` every `mqtt.heartbeat_interval_s` and
  on every state change: `up`, `draining` or `offline`, with each engine's state, version, tokens/s
  and last error; a last will publishes `offline` if the process dies;
* version announcements (`fleetrl/<run>/replicas/<region>`, or the policy where the region reads the
  home store): forwarded to the workers, which pull the version from the region store. Workers never
  poll the store except for a slow fallback (`rollout.weight_fallback_poll_s`);
* control commands on `fleetrl/<run>/control/<region>`: `drain` stops the workers after they hand
  their unfinished groups over as partials and keeps the node connected as `draining`; `resume`
  starts them again; `stop` hands over and exits 0;
* preemption notices (`fleetrl.regions.preemption`, `fleetrl.regions.cloud_notices`): SIGTERM, a notice
  file or a cloud's metadata service make the agent hand over within the notice's window, publish
  `offline` and exit 0.

The agent survives what it can: it starts and keeps running while MQTT is down (the client reconnects
in the background; heartbeats resume when it is back), and a worker that dies because the region's
Kafka or store is down is restarted with backoff until they return. Only a bad config or identity is
fatal.

State machine (`offline` is only ever the last word):

    up ──drain──▶ draining ──resume──▶ up
    up | draining ──stop / signal / notice──▶ (hand over) ──▶ offline, exit 0
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import pathlib
import tempfile
import time
from collections.abc import Sequence
from typing import Any, Literal

import yaml

from fleetrl.broker import ControlCommand, ControlPlane, ControlPlaneError, Heartbeat
from fleetrl.config import Capacity, FleetConfig
from fleetrl.log import get_logger
from fleetrl.regions.cloud_notices import node_capacity
from fleetrl.regions.errors import AgentError
from fleetrl.regions.identity import check_identity
from fleetrl.regions.metrics import AgentMetrics
from fleetrl.regions.preemption import Notice, PreemptionWatcher, SignalWatcher
from fleetrl.regions.supervisor import EngineSupervisor
from fleetrl.rollout import engine_config, engine_devices
from fleetrl.rollout.announcements import announced_version
from fleetrl.runtime import cancel_all, describe_task

log = get_logger(__name__)
State = Literal["up", "draining", "offline"]
_HANDOVER_SLACK_S = 5.0  # beyond the worker's own bounds (intake h/2 + handover h) before we kill it
_WINDOW_MARGIN_S = 5.0  # of a notice window, kept for killing stragglers and the last heartbeat
_CANCEL_WAIT_S = 5.0  # for the agent's own tasks to end once cancelled
_VERSION_CHECK_S = 1.0  # bound on how late an announcement missed between two waits is forwarded


class RegionAgent:
    """One node's agent; `await run()` returns the reason it stopped (`sigterm`, `preempted`, `stop`)."""

    def __init__(self, config: FleetConfig, region: str, node: str, *,
                 watchers: Sequence[PreemptionWatcher] | None = None, config_path: str | None = None) -> None:
        check_identity(config, region, node)
        self.config, self.region, self.node = config, region, node
        self.watchers = list(watchers) if watchers is not None else [SignalWatcher()]
        self.client_id = f"fleetrl-agent-{region}-{node}"
        self.state: State = "up"
        self.exit_reason: str | None = None
        self.notice: Notice | None = None
        self._config_path = config_path
        self._draining = False
        self._changed = asyncio.Event()  # a command or notice the supervisor must look at
        self._beat_now = asyncio.Event()  # a state change to publish before the next interval
        self._cp: ControlPlane | None = None
        self.engines: list[EngineSupervisor] = []
        self._running: dict[int, asyncio.Task[None]] = {}
        self.metrics = AgentMetrics()
        self.metrics_port: int | None = None
        self.started_at = time.time()
        self.capacity: Capacity = config.region(region).node_capacity(node)
        """On-demand or spot (`cloud_notices.node_capacity`): the heartbeat says it, the trainer prices by it."""

    # -- the daemon -----------------------------------------------------------------------------

    async def run(self) -> str:
        watching = [asyncio.create_task(self._watch(w), name=f"watch-{type(w).__name__}") for w in self.watchers]
        await asyncio.sleep(0)  # let signal watchers take their signals before the slow start-up
        tmp: tempfile.TemporaryDirectory[str] | None = None
        try:
            if self._config_path is None:  # in-process use: the workers read the same config from a file
                tmp = tempfile.TemporaryDirectory(prefix="fleetrl-agent-")
                self._config_path = str(pathlib.Path(tmp.name) / "fleet.yaml")
                pathlib.Path(self._config_path).write_text(yaml.safe_dump(self.config.model_dump(mode="json")))
            self.engines = self._supervisors(self._config_path)
            self.capacity = await asyncio.to_thread(node_capacity, self.config, self.region, self.node)
            if self.config.rollout.metrics_port is not None:
                self.metrics.health = self._health_line
                self.metrics_port = self.metrics.serve(self.config.rollout.metrics_port)
                log.info("agent.metrics", region=self.region, node=self.node, port=self.metrics_port)
            async with ControlPlane(self.config, self.client_id, will=(self.region, self.node), watch_nodes=False,
                                    watch_replicas=True, wait_connected=False) as cp:
                self._cp = cp
                await self._serve(cp)
        finally:
            await _cancel_all(watching, self.region, self.node)
            for w in self.watchers:
                w.close()
            self.metrics.close()
            if tmp is not None:
                tmp.cleanup()
        log.info("agent.stopped", region=self.region, node=self.node, reason=self.exit_reason)
        return self.exit_reason or "stop"

    def _supervisors(self, config_path: str) -> list[EngineSupervisor]:
        kind = engine_config(self.config, self.region, self.node).kind
        return [EngineSupervisor(self.config, config_path, self.region, self.node, i, device, kind=kind)
                for i, device in enumerate(engine_devices(self.config, self.region, self.node))]

    async def _serve(self, cp: ControlPlane) -> None:
        tasks = [asyncio.create_task(self._heartbeats(), name="heartbeats"),
                 asyncio.create_task(self._commands(cp), name="commands"),
                 asyncio.create_task(self._forward_versions(cp), name="versions")]
        log.info("agent.started", region=self.region, node=self.node, engines=len(self.engines))
        try:
            await self._supervise(tasks)
            await self._stop_engines(self.exit_reason or "stop")
        finally:
            for engine in self.engines:
                engine.kill()  # only stragglers are left here: a handover that ran out of time, a crash
            await _cancel_all([*tasks, *self._running.values()], self.region, self.node)
            self._set_state("offline")  # the workers are stopped: the heartbeat says the node `left`
            cp.farewell = self.heartbeat()
            with contextlib.suppress(ControlPlaneError):  # the last will says it anyway (without `left`)
                await self._publish_heartbeat(timeout_s=2.0)

    async def _supervise(self, tasks: list[asyncio.Task[None]]) -> None:
        """Keep the engines running while `up`; stop them on drain; return on exit."""
        while self.exit_reason is None:
            if self._draining:
                if any(not t.done() for t in self._running.values()):
                    await self._stop_engines("drain")
            else:
                for engine in self.engines:
                    task = self._running.get(engine.index)
                    if task is None or task.done():
                        self._running[engine.index] = asyncio.create_task(engine.run(), name=f"engine-{engine.index}")
            await self._until_changed(tasks)

    async def _stop_engines(self, reason: str) -> None:
        """Every worker hands its unfinished groups over (as partials) and exits, within the bound."""
        handover_s, bound_s = self._handover_bounds()
        log.info("agent.handing_over", region=self.region, node=self.node, reason=reason, bound_s=round(bound_s, 1))
        worker_reason = reason if reason in ("drain", "stop", "preempted") else "sigterm"
        await asyncio.gather(*(e.stop(worker_reason, handover_s, bound_s) for e in self.engines))
        running = [t for t in self._running.values() if not t.done()]
        if running:
            await asyncio.wait(running, timeout=5.0)

    def _handover_bounds(self) -> tuple[float, float]:
        """(the workers' handover timeout, the bound after which they are killed). A notice window
        shortens both so that the node is gone, offline, before the cloud takes it."""
        handover_s = self.config.rollout.handover_timeout_s
        if self.notice is not None and self.notice.window_s is not None:
            usable_s = max(1.0, self.notice.window_s - _WINDOW_MARGIN_S)
            handover_s = min(handover_s, usable_s / 1.5)
            return handover_s, usable_s
        return handover_s, 1.5 * handover_s + _HANDOVER_SLACK_S

    async def _until_changed(self, tasks: list[asyncio.Task[None]]) -> None:
        """Wait for a command or notice; a dead helper task (commands, heartbeats) is fatal."""
        self._changed.clear()
        changed = asyncio.ensure_future(self._changed.wait())
        try:
            await asyncio.wait({changed, *tasks}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            changed.cancel()
        for task in tasks:
            if task.done():
                task.result()
                raise AgentError(f"{task.get_name()} of {self.region}/{self.node} stopped")

    # -- inputs: notices, commands, versions ----------------------------------------------------

    async def _watch(self, watcher: PreemptionWatcher) -> None:
        notice = await watcher.wait()
        log.info("agent.notice", region=self.region, node=self.node, reason=notice.reason, detail=notice.detail,
                 window_s=notice.window_s)
        if self.notice is None:
            self.notice = notice
        self._request_exit(notice.reason)

    async def _commands(self, cp: ControlPlane) -> None:
        async for command in cp.commands(self.region):
            self.on_command(command)

    async def _forward_versions(self, cp: ControlPlane) -> None:
        while True:
            version = announced_version(self.config, cp, self.region)
            if version is not None:
                for engine in self.engines:
                    engine.notify(version)
            await cp.changed(timeout_s=_VERSION_CHECK_S)

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

    # -- heartbeats, health ---------------------------------------------------------------------

    def _set_state(self, state: State) -> None:
        if state != self.state:
            log.info("agent.state", region=self.region, node=self.node, state=state, previous=self.state)
            self.state = state
            self._beat_now.set()
        self._changed.set()

    def heartbeat(self) -> Heartbeat:
        """The node's state as the control plane shows it."""
        engines = [e.status() for e in self.engines]
        versions = [e.version for e in engines if e.version is not None]
        return Heartbeat(state=self.state, left=self.state == "offline", version=min(versions) if versions else None,
                         capacity=self.capacity, tokens_sampled=sum(e.tokens_sampled for e in engines),
                         started_at=self.started_at,
                         tokens_per_s=round(sum(e.tokens_per_s for e in engines), 2) if self.state == "up" else 0.0,
                         busy_tokens_per_s=round(sum(e.busy_tokens_per_s for e in engines), 2)
                         if self.state == "up" else 0.0,
                         in_flight=sum(e.in_flight for e in engines), engines=engines)

    def health(self) -> tuple[bool, dict[str, Any]]:
        """For /healthz: healthy while the agent serves and no engine is in crashloop."""
        beat = self.heartbeat()
        engines = beat.engines if isinstance(beat.engines, list) else []
        ok = self.state != "offline" and not any(e.state == "crashloop" for e in engines)
        return ok, {"state": self.state, "mqtt_connected": self._cp is not None and self._cp.connected,
                    "engines": [{"index": e.index, "state": e.state, "version": e.version} for e in engines]}

    def _health_line(self) -> tuple[bool, str]:
        ok, details = self.health()
        return ok, json.dumps({"ok": ok, **details}, separators=(",", ":"))

    async def _heartbeats(self) -> None:
        interval_s = self.config.mqtt.heartbeat_interval_s
        while True:
            self._beat_now.clear()
            try:
                await self._publish_heartbeat(timeout_s=max(interval_s, 1.0))
            except ControlPlaneError as exc:  # the client reconnects by itself; the next beat may land
                log.warning("agent.heartbeat_failed", region=self.region, node=self.node, error=str(exc))
            # asyncio.timeout, not wait_for: on 3.11, wait_for swallows a cancel that lands as the event
            # fires, and this loop then outlives the agent's shutdown (seen as a hang after SIGTERM).
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(interval_s):
                    await self._beat_now.wait()

    async def _publish_heartbeat(self, timeout_s: float | None = None) -> None:
        beat = self.heartbeat()
        self.metrics.update(beat, self.engines)
        if self._cp is not None:
            await self._cp.heartbeat(self.region, self.node, beat, timeout_s=timeout_s)


async def _cancel_all(tasks: list[asyncio.Task[Any]], region: str, node: str) -> None:
    """Cancel the agent's tasks and wait for them, boundedly: a task that ignores its cancel (a library
    that swallows it) is named with where it stands, and left behind rather than hanging the exit."""
    for task in await cancel_all(tasks, _CANCEL_WAIT_S):
        log.error("agent.task_ignored_cancel", region=region, node=node, task=describe_task(task))
