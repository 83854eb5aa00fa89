"""Supervision of one engine's rollout worker process (DESIGN.md §1; `fleetrl.rollout.supervised`).

An `EngineSupervisor` owns engine `index` of its node: it starts the worker as a child process
(`python -m fleetrl.rollout --supervised --engine-index I`), forwards version announcements to it,
reads its progress reports and relays its log lines, and restarts it when it crashes or hangs:

* crashed: the process exited while nobody asked it to stop;
* hung: no progress report within `agent.start_timeout_s` of its start or `agent.hang_timeout_s` of the
  last one, or work in the engine and no decoding step for `agent.hang_timeout_s`. A hung worker is
  SIGKILLed: its uncommitted groups go back to the region's consumer group and are redone there
  (the trainer deduplicates by group id).

Restarts back off exponentially from `agent.restart_backoff_s`, capped at `agent.restart_backoff_max_s`;
a worker that ran `agent.healthy_after_s` resets the backoff. After `agent.crashloop_after` quick
failures in a row the engine is reported `crashloop` with the last error line, and still retried at
the capped backoff, so a node whose cause of failure goes away (a GPU reset, a store back) recovers
by itself.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import sys
import time
from typing import Any

from fleetrl.broker import EngineState, EngineStatus
from fleetrl.config import FleetConfig
from fleetrl.log import get_logger

log = get_logger(__name__)
_TICK_S = 0.25  # how often a supervisor looks at its worker
_LINE_LIMIT = 1 << 20  # longest line read from a worker (a traceback line is far shorter)
_ERROR_CHARS = 300
_COUNTERS = ("gets", "lists", "groups_done", "handed_over", "region_responses", "region_skipped", "tokens_sampled")
DEAD_LETTERED = "dead_lettered:"
"""Prefix of the totals of records dead-lettered, one per reason (`dead_lettered:<reason>`)."""
REWARD_ERRORS = "reward_errors:"
"""Prefix of the totals of groups a custom reward function failed on, one per function."""


class EngineSupervisor:
    """Runs, watches and restarts one engine's worker; `run()` returns once `stop()` has finished."""

    def __init__(self, config: FleetConfig, config_path: str, region: str, node: str, index: int, device: str,
                 *, kind: str = "torch") -> None:
        self.config, self.cfg = config, config.agent
        self.region, self.node, self.index, self.device, self.kind = region, node, index, device, kind
        self.argv = [sys.executable, "-m", "fleetrl.rollout", "--config", config_path, "--region", region,
                     "--node", node, "--engine-index", str(index), "--supervised"]
        self.state: EngineState = "starting"
        self.proc: asyncio.subprocess.Process | None = None
        self.progress: dict[str, Any] = {}
        self.restarts = 0
        self.failures = 0
        """Quick failures in a row (reset by a worker that ran `healthy_after_s`)."""
        self.last_error = ""
        self.announced: int | None = None
        self.totals = dict.fromkeys(_COUNTERS, 0)
        """Counters summed over this engine's workers, the finished ones included: store requests
        (`gets`, `lists`), `groups_done`, `handed_over`, the region history's `region_responses` and
        `region_skipped`, `tokens_sampled`, and `dead_lettered:<reason>` per reason."""
        self._retired: dict[str, int] = dict.fromkeys(_COUNTERS, 0)
        self._stopping: str | None = None
        self._wake = asyncio.Event()

    # -- the loop -------------------------------------------------------------------------------

    async def run(self) -> None:
        """Start the worker and keep one running until `stop()`."""
        self._stopping = None
        while self._stopping is None:
            started = time.monotonic()
            await self._run_once()
            if self._stopping is not None:
                break
            await self._back_off(time.monotonic() - started)
        self._set_state("stopped")

    async def _run_once(self) -> None:
        self._set_state("starting")
        self.progress = {}
        try:
            proc = await asyncio.create_subprocess_exec(
                *self.argv, stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.PIPE, env=self._env(), limit=_LINE_LIMIT)
        except OSError as exc:
            self.last_error = f"cannot start worker: {exc}"
            return
        self.proc = proc
        log.info("agent.worker_started", region=self.region, node=self.node, engine=self.index, pid=proc.pid,
                 restarts=self.restarts)
        if self.announced is not None:
            self._send({"cmd": "version", "version": self.announced})
        readers = [asyncio.create_task(self._read_progress(proc)), asyncio.create_task(self._relay_logs(proc))]
        try:
            await self._watch(proc)
        finally:
            await asyncio.gather(*readers, return_exceptions=True)
            self._retire(proc)

    async def _watch(self, proc: asyncio.subprocess.Process) -> None:
        """Until the worker exits; kill it if it hangs."""
        started = last_report = steps_moved = time.monotonic()
        steps, reports = None, 0
        while proc.returncode is None:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(_TICK_S):
                    await proc.wait()
            now = time.monotonic()
            if self.progress.get("_n", 0) != reports:
                reports, last_report = self.progress["_n"], now
                if self.progress.get("engine_steps") != steps or not self.progress.get("busy"):
                    steps, steps_moved = self.progress.get("engine_steps"), now
            hung = self._hung(now, started, reports, last_report, steps_moved)
            if hung and proc.returncode is None and self._stopping is None:
                self.last_error = f"hung: {hung}"
                log.error("agent.worker_hung", region=self.region, node=self.node, engine=self.index,
                          pid=proc.pid, why=hung)
                with contextlib.suppress(ProcessLookupError):
                    proc.kill()
                await proc.wait()
        if self._stopping is None:
            log.error("agent.worker_exited", region=self.region, node=self.node, engine=self.index, pid=proc.pid,
                      returncode=proc.returncode, last_error=self.last_error,
                      uptime_s=round(time.monotonic() - started, 1))

    def _hung(self, now: float, started: float, reports: int, last_report: float, steps_moved: float) -> str:
        if self._stopping is not None:
            return ""
        if reports == 0:
            return f"no progress report within agent.start_timeout_s={self.cfg.start_timeout_s:g} s" \
                if now - started > self.cfg.start_timeout_s else ""
        if now - last_report > self.cfg.hang_timeout_s:
            return f"no progress report for agent.hang_timeout_s={self.cfg.hang_timeout_s:g} s"
        if now - steps_moved > self.cfg.hang_timeout_s:
            return f"work in the engine and no decoding step for {self.cfg.hang_timeout_s:g} s"
        return ""

    async def _back_off(self, uptime_s: float) -> None:
        self.failures = 1 if uptime_s >= self.cfg.healthy_after_s else self.failures + 1
        delay = min(self.cfg.restart_backoff_s * 2 ** (self.failures - 1), self.cfg.restart_backoff_max_s)
        self._set_state("crashloop" if self.failures >= self.cfg.crashloop_after else "restarting")
        log.warning("agent.worker_restart", region=self.region, node=self.node, engine=self.index,
                    in_s=round(delay, 2), failures=self.failures, state=self.state, last_error=self.last_error)
        self._wake.clear()
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(delay):
                await self._wake.wait()
        if self._stopping is None:
            self.restarts += 1

    # -- what the worker says -------------------------------------------------------------------

    async def _read_progress(self, proc: asyncio.subprocess.Process) -> None:
        assert proc.stdout is not None
        while line := await proc.stdout.readline():
            try:
                report = json.loads(line)["progress"]
            except (ValueError, KeyError, TypeError):
                log.warning("agent.worker_bad_report", engine=self.index, line=line[:200].decode(errors="replace"))
                continue
            report["_n"] = self.progress.get("_n", 0) + 1
            self.progress = report
            current = {**report, **(report.get("store") or {}),
                       **{DEAD_LETTERED + r: n for r, n in (report.get("dead_lettered") or {}).items()},
                       **{REWARD_ERRORS + f: st.get("errors", 0) for f, st in (report.get("rewards") or {}).items()}}
            keys = {*_COUNTERS, *self._retired, *(k for k in current if k.startswith((DEAD_LETTERED, REWARD_ERRORS)))}
            self.totals = {k: self._retired.get(k, 0) + int(current.get(k, 0)) for k in keys}
            if report.get("weights") is not None and self.state in ("starting", "restarting", "crashloop") \
                    and self._stopping is None:
                self._set_state("up")

    async def _relay_logs(self, proc: asyncio.subprocess.Process) -> None:
        """The worker's log lines go to the agent's stderr (the journal); error lines are remembered."""
        assert proc.stderr is not None
        while raw := await proc.stderr.readline():
            line = raw.decode(errors="replace").rstrip()
            sys.stderr.write(line + "\n")
            if _is_error(line):
                self.last_error = line[:_ERROR_CHARS]
        sys.stderr.flush()

    def _retire(self, proc: asyncio.subprocess.Process) -> None:
        self._retired = dict(self.totals)
        if self.proc is proc:
            self.proc = None

    # -- what the agent tells it ----------------------------------------------------------------

    def notify(self, version: int) -> None:
        """The region store holds `version`: tell the worker (and every worker started later)."""
        if self.announced is None or version > self.announced:
            self.announced = version
            self._send({"cmd": "version", "version": version})

    async def stop(self, reason: str, handover_timeout_s: float, bound_s: float) -> None:
        """Ask the worker to hand over and exit; SIGKILL it if it takes longer than `bound_s`."""
        self._stopping = reason
        self._wake.set()
        proc = self.proc
        if proc is None or proc.returncode is not None:
            return
        self._send({"cmd": "stop", "reason": reason, "handover_timeout_s": handover_timeout_s})
        try:
            await asyncio.wait_for(proc.wait(), timeout=bound_s)
        except TimeoutError:
            log.error("agent.worker_stop_timeout", region=self.region, node=self.node, engine=self.index,
                      pid=proc.pid, bound_s=bound_s)
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            await proc.wait()

    def kill(self) -> None:
        """SIGKILL the worker now (the agent is leaving faster than a handover)."""
        if self.proc is not None and self.proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.proc.pid, signal.SIGKILL)

    def _send(self, message: dict[str, Any]) -> None:
        proc = self.proc
        if proc is None or proc.stdin is None or proc.stdin.is_closing():
            return
        with contextlib.suppress(ConnectionError, RuntimeError):  # it died: _watch sees the exit
            proc.stdin.write(json.dumps(message).encode() + b"\n")

    # -- what the agent reports -----------------------------------------------------------------

    def status(self) -> EngineStatus:
        p, up = self.progress, self.state == "up"
        return EngineStatus(index=self.index, device=self.device, state=self.state,
                            pid=self.proc.pid if self.proc is not None else None, restarts=self.restarts,
                            version=p.get("weights"), tokens_per_s=float(p.get("tokens_per_s", 0.0)) if up else 0.0,
                            busy_tokens_per_s=float(p.get("busy_tokens_per_s", 0.0)) if up else 0.0,
                            in_flight=int(p.get("groups_in_flight", 0)), tokens_sampled=self.totals["tokens_sampled"],
                            last_error=self.last_error)

    def _set_state(self, state: EngineState) -> None:
        if state != self.state:
            log.info("agent.engine_state", region=self.region, node=self.node, engine=self.index, state=state,
                     previous=self.state)
            self.state = state

    def _env(self) -> dict[str, str]:
        env = dict(os.environ)
        if self.kind == "vllm" and self.device:
            env["CUDA_VISIBLE_DEVICES"] = self.device
        return env


def _is_error(line: str) -> bool:
    """A worker's error line: a JSON event at error level or above, or anything not JSON (tracebacks,
    the one-line fatal message)."""
    if not line.startswith("{"):
        return bool(line.strip())
    try:
        level = json.loads(line).get("level", "")
    except ValueError:
        return True
    return level in ("error", "critical")
