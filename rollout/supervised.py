"""A rollout worker run as a child process of its region agent (DESIGN.md §1; `fleetrl.regions`).

    python -m fleetrl.rollout --config fleet.yaml --region R --node N --engine-index I --supervised

The agent and the worker speak JSON lines over the worker's stdin and stdout:

* agent -> worker (stdin): `{"cmd": "version", "version": N}`: the region store holds N (the agent
  heard it on the control plane): pull it. `{"cmd": "stop", "reason": R, "handover_timeout_s": T}`:
  stop admitting, hand unfinished groups over as partials (reason R: `drain`, `stop`, `sigterm`,
  `preempted`) within T seconds, commit, exit 0. End of input means the agent is gone: the same
  handover, reason `sigterm`, so a worker never outlives its agent by more than its handover.
* worker -> agent (stdout): `{"progress": {...}}` every `agent.progress_interval_s` and once the first
  weights are loaded: the worker's stats (engine steps, groups, version, tokens/s) and its hub store's
  request counters. The agent reads a silent worker, or one with work whose engine steps stop
  moving, as hung.

Logs go to stderr as JSON events; the agent relays them and keeps the last error line. The protocol
writes through a private copy of the original stdout: anything a library prints lands on stderr.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import sys
import time
from typing import IO, Any

from fleetrl.config import FleetConfig
from fleetrl.log import get_logger
from fleetrl.rollout.worker import RolloutWorker, build_engine

log = get_logger(__name__)
_REASONS = ("drain", "stop", "sigterm", "preempted")


class _Channel:
    """The worker's end of the pipe pair: commands in, progress out."""

    def __init__(self) -> None:
        self.out: IO[str] = os.fdopen(os.dup(1), "w", buffering=1)
        os.dup2(2, 1)  # stray prints go to the log stream, never into the protocol
        sys.stdout = sys.stderr

    def send(self, **message: Any) -> None:
        with contextlib.suppress(BrokenPipeError, ValueError):  # the agent is gone: stdin EOF says so too
            self.out.write(json.dumps(message, separators=(",", ":")) + "\n")

    async def commands(self) -> asyncio.StreamReader:
        loop = asyncio.get_running_loop()
        reader = asyncio.StreamReader(limit=1 << 16)
        await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
        return reader


async def serve_supervised(config: FleetConfig, region: str, node: str, engine_index: int) -> None:
    """Build engine `engine_index`, run the worker until told to stop, hand over and return."""
    channel = _Channel()
    started = time.monotonic()
    engine = await asyncio.to_thread(build_engine, config, region, node, engine_index)
    log.info("worker.engine_built", engine=engine_index, seconds=round(time.monotonic() - started, 3))
    worker = RolloutWorker(config, region, node, engine=engine)
    stop, preempted = asyncio.Event(), asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, _stop, worker, stop, preempted, "sigterm", None)
    reader = await channel.commands()
    tasks = [asyncio.create_task(_read_commands(reader, worker, stop, preempted), name="agent-commands"),
             asyncio.create_task(_report(channel, worker, config.agent.progress_interval_s), name="progress")]
    try:
        await worker.run(stop, preempted)
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        channel.send(progress=_progress(worker), stopped=True)


def _stop(worker: RolloutWorker, stop: asyncio.Event, preempted: asyncio.Event, reason: str,
          handover_timeout_s: float | None) -> None:
    if stop.is_set() or preempted.is_set():
        return
    if handover_timeout_s is not None:
        worker.handover_timeout_s = min(worker.handover_timeout_s, handover_timeout_s)
    log.info("worker.stop_requested", reason=reason, handover_timeout_s=worker.handover_timeout_s)
    if reason == "preempted":
        preempted.set()
    else:
        worker.stop_reason = reason
        stop.set()


async def _read_commands(reader: asyncio.StreamReader, worker: RolloutWorker, stop: asyncio.Event,
                         preempted: asyncio.Event) -> None:
    while line := await reader.readline():
        try:
            cmd = json.loads(line)
            kind = cmd["cmd"]
            if kind == "version":
                worker.weights.notify(int(cmd["version"]))
            elif kind == "stop" and cmd.get("reason") in _REASONS:
                timeout = cmd.get("handover_timeout_s")
                _stop(worker, stop, preempted, cmd["reason"], float(timeout) if timeout is not None else None)
            else:
                raise ValueError(f"unknown command {kind!r}")
        except (ValueError, KeyError, TypeError) as exc:  # a bad line from our own agent: say so, go on
            log.error("worker.bad_command", line=line[:200].decode(errors="replace"), error=str(exc))
    log.warning("worker.agent_gone", hint="stdin closed: handing over and exiting")
    _stop(worker, stop, preempted, "sigterm", None)


async def _report(channel: _Channel, worker: RolloutWorker, interval_s: float) -> None:
    loaded = False
    while True:
        channel.send(progress=_progress(worker))
        if loaded:
            await asyncio.sleep(interval_s)
            continue
        with contextlib.suppress(TimeoutError):  # report the first weights as soon as they are in
            async with asyncio.timeout(interval_s):
                while worker.weights.have is None:
                    await asyncio.sleep(0.05)
        loaded = worker.weights.have is not None


def _progress(worker: RolloutWorker) -> dict[str, Any]:
    s = worker.hub.store.stats
    return {**worker.stats(), "store": {"gets": s.gets, "lists": s.lists, "object_gets": s.object_gets,
                                        "get_bytes": s.get_bytes}}
