"""Named crash points: a test-only switch that makes a process SIGKILL itself between two durable effects.

FleetRL's correctness rests on a few sequences of durable effects (publish, checkpoint-then-commit,
replicate-then-hold, produce-then-commit). A crash between two of them leaves a distinct state, and
every such state must be recoverable by a plain restart. Random kills rarely land in a window a few
milliseconds wide, so each window has a name here, and the code calls `crash_point(name)` there:

    FLEETRL_CRASH_AT=hub.publish.manifest_written,trainer.checkpoint.renamed@2
    FLEETRL_CRASH_DIR=/tmp/crashes

`FLEETRL_CRASH_AT` is a sequence: the first entry not yet fired is armed; a process fires it at its
`@N`-th hit of that point (default the first) by creating `<FLEETRL_CRASH_DIR>/<index>-<point>`
(exclusively, with its pid inside: two processes armed alike fire it once), writing one JSON line to
stderr and sending itself SIGKILL. The marker survives the process, so its restart (systemd's
`Restart=`, the demo's supervisor) arms the next entry. Naming the same point twice crashes the
restart when it passes there again (a restart that dies while rolling forward must recover too).
Without `FLEETRL_CRASH_DIR` the sequence lives in the process alone.

The switch is read from the environment once, at import; when `FLEETRL_CRASH_AT` is unset
`crash_point` is one global load and a return. It is not a config field: `fleet.yaml` cannot set it,
and `FLEETRL_CRASH_AT` is not an override (no top-level config field is called `crash_at`).

`POINTS` is the registry: every name the code may pass, with the process kind that reaches it and
the state a crash there leaves (docs/crashpoints.md is the table of it, with how restart recovers).
"""

from __future__ import annotations

import json
import os
import pathlib
import signal
import sys
import threading
import time
from dataclasses import dataclass

ENV_POINTS = "FLEETRL_CRASH_AT"
ENV_DIR = "FLEETRL_CRASH_DIR"


@dataclass(frozen=True, slots=True)
class Point:
    kind: str
    """The process that reaches it: trainer, replicator, worker or gc (`fleetrl hub gc`)."""
    leaves: str
    """The durable state a crash here leaves behind."""


POINTS: dict[str, Point] = {
    # the trainer's step: train -> snapshot -> checkpoint (weights, state, rename) -> commit offsets
    "trainer.step.snapshot_taken": Point(
        "trainer", "a step trained in memory and its bf16 snapshot taken; nothing of it durable"),
    "trainer.checkpoint.weights_written": Point(
        "trainer", "a checkpoint's weight shards in step-N.tmp/, no state file, not renamed"),
    "trainer.checkpoint.state_written": Point(
        "trainer", "step-N.tmp/ complete (weights and state, fsynced) but not renamed"),
    "trainer.checkpoint.renamed": Point(
        "trainer", "checkpoint step-N durable; the Kafka offsets it covers not committed"),
    "trainer.offsets.committed": Point(
        "trainer", "checkpoint step-N durable and its offsets committed"),
    # the publisher (in the trainer): objects -> manifest -> home holder -> latest -> announce
    "hub.publish.objects_written": Point(
        "trainer", "version N's objects in the home store, no manifest (unreferenced objects)"),
    "hub.publish.manifest_written": Point(
        "trainer", "version N's manifest created, `latest` still at N-1, no home holder reference"),
    "hub.publish.holder_written": Point(
        "trainer", "version N's manifest and home holder reference, `latest` still at N-1"),
    "trainer.publish.latest_moved": Point(
        "trainer", "`latest` at N; the retained MQTT policy message still at N-1"),
    "trainer.publish.announced": Point(
        "trainer", "version N published and announced"),
    # the dispatcher (in the trainer): prompt produced -> ledger updated
    "trainer.dispatch.prompt_produced": Point(
        "trainer", "a prompt acknowledged by its region's Kafka, not yet in the ledger's dispatch record"),
    "trainer.dispatch.ledger_updated": Point(
        "trainer", "a prompt produced and noted in the ledger (in memory: durable at the next checkpoint)"),
    # the replicator: objects -> manifest -> region holder -> home holder -> region latest -> announce
    "hub.replicate.objects_copied": Point(
        "replicator", "version N's objects in the region store, no manifest there"),
    "hub.replicate.manifest_copied": Point(
        "replicator", "version N's manifest in the region store, no holder reference, region `latest` at N-1"),
    "hub.replicate.holder_written": Point(
        "replicator", "the region's holder reference of N in its own store, not in the home store"),
    "hub.replicate.home_holder_written": Point(
        "replicator", "holder references of N in both stores, the region's `latest` still at N-1"),
    "hub.replicate.latest_moved": Point(
        "replicator", "the region's `latest` at N; its retained replica announcement still at N-1"),
    "hub.replicate.backfilled": Point(
        "replicator", "a catch-up of several versions stopped after N: versions up to N whole in the region "
                      "store, its `latest` at N, N+1.. not copied yet"),
    "replicator.announced": Point(
        "replicator", "the region's replica announcement at N"),
    # the rollout worker: record produced -> offsets committed
    "rollout.group.produced": Point(
        "worker", "a finished group acknowledged in `trajectories`; its prompt's offset not committed"),
    "rollout.partial.produced": Point(
        "worker", "an unfinished group acknowledged in `partials`; its prompt's offset not committed"),
    "rollout.offsets.committed": Point(
        "worker", "the offsets of every delivery whose record landed committed"),
    # retention (`fleetrl hub gc`): manifests -> holder references -> objects, each in order
    "hub.gc.manifest_deleted": Point(
        "gc", "one manifest older than the window deleted (oldest first), the rest still there"),
    "hub.gc.holder_deleted": Point(
        "gc", "every old manifest deleted, some of their holder references still there"),
    "hub.gc.object_deleted": Point(
        "gc", "old manifests and holder references gone, some unreferenced objects still there"),
}


class CrashPointError(ValueError):
    """`FLEETRL_CRASH_AT` names a point that does not exist (or a bad `@N`)."""


@dataclass(frozen=True, slots=True)
class Armed:
    index: int
    point: str
    hit: int


def parse(text: str) -> list[Armed]:
    """`point[@N],point[@N],...` -> the sequence; unknown names are refused with the known ones."""
    out: list[Armed] = []
    for i, entry in enumerate(e.strip() for e in text.split(",") if e.strip()):
        name, _, hit = entry.partition("@")
        if name not in POINTS:
            raise CrashPointError(f"{ENV_POINTS}: no crash point {name!r}; known: {', '.join(sorted(POINTS))}")
        try:
            n = int(hit) if hit else 1
        except ValueError:
            raise CrashPointError(f"{ENV_POINTS}: {entry!r}: @N must be a whole number") from None
        if n < 1:
            raise CrashPointError(f"{ENV_POINTS}: {entry!r}: @N must be at least 1")
        out.append(Armed(i, name, n))
    return out


def marker_name(armed: Armed) -> str:
    return f"{armed.index:02d}-{armed.point}"


class _Plan:
    def __init__(self, sequence: list[Armed], directory: pathlib.Path | None) -> None:
        self.sequence, self.directory = sequence, directory
        self.hits: dict[str, int] = {}
        self.fired_here: set[int] = set()
        self.lock = threading.Lock()

    def armed(self) -> Armed | None:
        for a in self.sequence:
            if a.index in self.fired_here:
                continue
            if self.directory is not None and (self.directory / marker_name(a)).exists():
                continue
            return a
        return None

    def hit(self, name: str) -> None:
        with self.lock:
            armed = self.armed()
            if armed is None or armed.point != name:
                return
            self.hits[name] = self.hits.get(name, 0) + 1
            if self.hits[name] < armed.hit or not self._claim(armed):
                return
        _die(armed)

    def _claim(self, armed: Armed) -> bool:
        """Create the marker (exclusive): False when another process fired this entry first."""
        self.fired_here.add(armed.index)
        if self.directory is None:
            return True
        self.directory.mkdir(parents=True, exist_ok=True)
        try:
            fd = os.open(self.directory / marker_name(armed), os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            return False
        try:
            os.write(fd, json.dumps({"pid": os.getpid(), "point": armed.point, "hit": armed.hit,
                                     "t": time.time()}).encode())
            os.fsync(fd)
        finally:
            os.close(fd)
        return True


def _die(armed: Armed) -> None:
    line = json.dumps({"event": "crashpoint.hit", "point": armed.point, "hit": armed.hit, "index": armed.index,
                       "pid": os.getpid(), "level": "warning", "timestamp": time.time()})
    try:
        sys.stderr.write(line + "\n")
        sys.stderr.flush()
    finally:
        os.kill(os.getpid(), signal.SIGKILL)


def _load() -> _Plan | None:
    text = os.environ.get(ENV_POINTS)
    if not text:
        return None
    directory = os.environ.get(ENV_DIR)
    return _Plan(parse(text), pathlib.Path(directory) if directory else None)


_PLAN = _load()


def crash_point(name: str) -> None:
    """SIGKILL this process here when the test-only switch arms `name` (see the module docstring)."""
    if _PLAN is not None:
        _PLAN.hit(name)


def fired(directory: pathlib.Path) -> list[dict[str, object]]:
    """The markers in `directory`, in sequence order: {index, point, hit, pid, t} each."""
    out: list[dict[str, object]] = []
    if not directory.is_dir():
        return out
    for path in sorted(directory.iterdir()):
        index, _, point = path.name.partition("-")
        try:
            data = json.loads(path.read_text() or "{}")
        except ValueError:
            data = {}
        out.append({"index": int(index), "point": point, **data})
    return out
