"""Faults injected into a running demo, on the production code path (`fleetrl demo --kill-every ...`).

    --kill-every S          SIGKILL a random live process every S s (trainer, an agent, a rollout worker,
                            a replicator, and with --durable a region's tansu) and restart it after
                            `RESTART_S`, as systemd's Restart=always would (a worker is restarted by its
                            agent's supervisor, as in production)
    --preempt-every S       create the notice file of a random live agent whose worker is generating
                            (its `--notice-file`, the file notice source): it hands over and exits 0;
                            a replacement node `<node>-r<k>` starts in its region, as a spot fleet
                            replaces a node
                            (both wait for the fleet's first step, and each kill or notice for a step
                            after the last one and its restart: `Chaos.caught_up`)
    --partition R:START:S   cut region R's links home (Kafka to the trainer, MQTT, the home store) at
                            START s for S s, through the relays of `fleetrl.demo.relay`
    --fuzz-rate R           a fraction R of the records in prompts and trajectories are hostile,
                            from the fuzzing producer (`fleetrl.demo.fuzz`)
    --fuzz-records N        exactly N hostile records (paced by --fuzz-rate when given); the run ends
                            once every one of them is dead-lettered
    --until-faults          end the run (the trainer drains) once every fault asked for has happened and
                            been recovered from (`Chaos.done`), instead of after --steps or --duration
    --crash-at P[,P...]     named crash points (`fleetrl.crashpoints`): the trainer, the replicators and
                            the rollout workers each get their kind's points, in order, and SIGKILL
                            themselves exactly there; the demo restarts the trainer and replicators
                            after `RESTART_S` (a worker is restarted by its agent's supervisor)

`Chaos.tick()` runs in the demo's watch loop; every fault is recorded as `{t, kind, target}` (t in
seconds since the demo started) for the live view, `faults.jsonl`, the summary and the plot.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import pathlib
import random
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import psutil

from fleetrl import crashpoints
from fleetrl.cli_args import ArgumentRefused, kinds
from fleetrl.demo.procs import Child, DemoError

KILL_KINDS = ("trainer", "agent", "worker", "replicator", "broker")
CRASH_KINDS = ("trainer", "replicator", "worker")
"""The process kinds of the demo that reach crash points (`fleetrl.crashpoints.POINTS`)."""
RESTART_S = 1.0
"""Seconds between a kill and the restart (systemd's RestartSec)."""
RECOVER_S = 20.0
"""Default of `--recover`: a restarted process is not killed again for this long. A trainer needs ~10 s on
2 busy cores to load torch and resume from its checkpoint, and killing it again before it trains a step
proves nothing; a machine much slower than that needs a longer one."""
TRAINER_RECOVER_FACTOR = 6
"""A restarted trainer is spared until it checkpoints, at most this many `--recover` spans (120 s by
default): on busy cores its start, its group joins and the first groups' arrival can take longer than
RECOVER_S, and a trainer killed after each first step but before its next checkpoint redoes that step
forever (a 20-minute soak with a kill every 5 s sat at step 15 for minutes that way). For the same reason
the trainer is never killed before the run's first checkpoint."""


@dataclass(frozen=True, slots=True)
class Partition:
    region: str
    start_s: float
    seconds: float


def parse_partition(text: str) -> Partition:
    """`REGION:START:SECONDS`, e.g. `local-b:20:20`."""
    parts = text.rsplit(":", 2)
    try:
        if len(parts) != 3 or not parts[0]:
            raise ValueError
        p = Partition(parts[0], float(parts[1]), float(parts[2]))
    except ValueError:
        raise argparse.ArgumentTypeError(f"--partition {text!r}: expected REGION:START:SECONDS, "
                                         f"e.g. local-b:20:20") from None
    if p.start_s < 0 or p.seconds <= 0:
        raise argparse.ArgumentTypeError(f"--partition {text!r}: START must be >= 0 and SECONDS > 0")
    return p


def parse_kill_only(text: str) -> tuple[str, ...]:
    """`KIND[,KIND]`, each one of `KILL_KINDS`."""
    return kinds(KILL_KINDS, text)


def parse_crash_at(text: str) -> tuple[str, ...]:
    """`POINT[@N][,POINT...]`: named crash points (`fleetrl.crashpoints`) that a demo process reaches."""
    try:
        armed = crashpoints.parse(text)
    except crashpoints.CrashPointError as exc:
        raise argparse.ArgumentTypeError(str(exc).removeprefix(f"{crashpoints.ENV_POINTS}: ")) from None
    outside = sorted({a.point for a in armed if crashpoints.POINTS[a.point].kind not in CRASH_KINDS})
    if outside:
        raise argparse.ArgumentTypeError(f"{outside} are not reached by a demo process (the gc points are "
                                         f"reached by `fleetrl hub gc`)")
    return tuple(e.strip() for e in text.split(",") if e.strip())


@dataclass(frozen=True, slots=True)
class FaultPlan:
    kill_every_s: float | None = None
    preempt_every_s: float | None = None
    partitions: tuple[Partition, ...] = ()
    fuzz_rate: float = 0.0
    fuzz_records: int = 0
    """A fixed number of hostile records (0: as many as `fuzz_rate` asks during the first third of the run)."""
    durable: bool = False
    seed: int = 0
    kill_only: tuple[str, ...] = KILL_KINDS
    crash_at: tuple[str, ...] = ()
    """Crash points (`point[@N]`), in order; each process kind runs those it reaches."""
    until_faults: bool = False
    """End the run once every fault asked for has happened and been recovered from."""
    recover_s: float = RECOVER_S
    """`--recover`: how long a restarted process is spared from kills (a trainer: until it checkpoints,
    at most TRAINER_RECOVER_FACTOR times this)."""

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> FaultPlan:
        """The plan of the parsed arguments, whose types (fleetrl/cli.py) checked each one; what only
        their combination can tell is refused here (`ArgumentRefused`: exit 2 before anything starts)."""
        rate = float(getattr(args, "fuzz_rate", 0.0) or 0.0)
        records = getattr(args, "fuzz_records", None)
        only = tuple(getattr(args, "kill_only", None) or KILL_KINDS)
        if "broker" in only and getattr(args, "kill_only", None) and not getattr(args, "durable", False):
            raise ArgumentRefused("--kill-only", "broker needs --durable: a broker on memory storage loses its log "
                                                 "when killed")
        crash_at = tuple(e for entries in (getattr(args, "crash_at", None) or ()) for e in entries)
        until = bool(getattr(args, "until_faults", False))
        plan = cls(getattr(args, "kill_every", None), getattr(args, "preempt_every", None),
                   tuple(getattr(args, "partition", None) or ()), rate, int(records or 0),
                   bool(getattr(args, "durable", False)), int(getattr(args, "seed", 0) or 0), only, crash_at, until,
                   float(getattr(args, "recover", None) or RECOVER_S))
        if until and not (plan.kill_every_s or plan.preempt_every_s or plan.partitions or plan.crash_at):
            raise ArgumentRefused("--until-faults", "no fault to wait for; add --kill-every, --preempt-every, "
                                                    "--partition or --crash-at")
        return plan

    @property
    def active(self) -> bool:
        return bool(self.kill_every_s or self.preempt_every_s or self.partitions or self.fuzzing or self.crash_at)

    @property
    def fuzzing(self) -> bool:
        return bool(self.fuzz_rate or self.fuzz_records)

    def crash_env(self, kind: str, directory: pathlib.Path) -> dict[str, str]:
        """The crash-point switch for the processes of `kind` (trainer, replicator, worker): its
        points in their order, and the folder where fired points leave their markers."""
        mine = [e for e in self.crash_at if crashpoints.POINTS[e.partition("@")[0]].kind == kind]
        if not mine:
            return {}
        return {crashpoints.ENV_POINTS: ",".join(mine), crashpoints.ENV_DIR: str(directory / kind)}


@dataclass(slots=True)
class Fault:
    t: float
    kind: str
    """kill, preempt, replace, partition, heal, restart."""
    target: str
    detail: str = ""


@dataclass
class FaultLog:
    started: float
    path: pathlib.Path
    faults: list[Fault] = field(default_factory=list)

    def add(self, kind: str, target: str, detail: str = "") -> Fault:
        fault = Fault(round(time.monotonic() - self.started, 2), kind, target, detail)
        self.faults.append(fault)
        with open(self.path, "a") as f:
            f.write(json.dumps(dataclasses.asdict(fault)) + "\n")
        return fault

    def injected(self) -> list[Fault]:
        """The faults themselves (not the restarts and heals that follow them)."""
        return [f for f in self.faults if f.kind in ("kill", "preempt", "partition")]


class Chaos:
    """Decides and injects faults; `demo` is the runner's `Demo` (its children, relays, progress)."""

    def __init__(self, plan: FaultPlan, demo: Any, log: FaultLog,
                 on_fault: Callable[[Fault], None] | None = None) -> None:
        self.plan, self.demo, self.log = plan, demo, log
        self.rng = random.Random(plan.seed)
        self.on_fault = on_fault or (lambda f: None)
        now = time.monotonic()
        self.next_kill = now + plan.kill_every_s if plan.kill_every_s else None
        self.next_preempt = now + plan.preempt_every_s if plan.preempt_every_s else None
        self.restarts: dict[str, tuple[float, Child]] = {}
        """Child name -> (when to restart it, the child): killed, waiting for their RestartSec."""
        self.restarted_at: dict[str, float] = {}
        """Child name -> when it was last restarted (spared from kills for RECOVER_S)."""
        self.kill_turn = 0
        self.leaving: set[str] = set()
        """Agents told to go (a notice): their exit 0 is expected."""
        self.cut: set[str] = set()
        self.replacements = 0
        self.stopped = False
        self.crash_dir = pathlib.Path(demo.workdir) / "crashes"
        self.crashes: dict[str, int] = {}
        """Marker (`<kind>/<index>-<point>`) of each crash point fired -> the pid it killed."""
        self.killed_training: set[str] = set()
        """Kinds killed once the fleet had trained a step (mid-flight, not during the fleet's start)."""
        self.last_fault_at: float | None = None
        """When (monotonic) the last kill, restart or preemption happened: the next one waits for a step
        after it (`caught_up`)."""

    def _fault(self, kind: str, target: str, detail: str = "") -> None:
        if kind in ("kill", "restart", "preempt", "replace"):
            self.last_fault_at = time.monotonic()
        self.on_fault(self.log.add(kind, target, detail))

    def expected_down(self, child: Child) -> bool:
        return (child.name in self.restarts or (child.name in self.leaving and child.returncode() == 0)
                or self._crashed(child))

    def tick(self) -> None:
        """Restarts that are due, crash points that fired, partitions, then (unless stopped) new faults."""
        now = time.monotonic()
        self._restart_due(now)
        self._crash_restarts()
        self._partitions(now - self.log.started)
        if self.stopped or not self.caught_up():
            return  # a kill or notice now would hit a fleet that has not trained since the last one
        # One fault a tick, the one due longest: after it the next waits for a step, and a kill and a
        # notice that are both due take turns (the kill, first every time, would starve the notices).
        due = [(at, act) for at, act in ((self.next_kill, "kill"), (self.next_preempt, "preempt"))
               if at is not None and now >= at]
        if not due:
            return
        if min(due)[1] == "kill":
            self.next_kill = now + (self.plan.kill_every_s or 0)
            self._kill_one()
        else:
            self.next_preempt = now + (self.plan.preempt_every_s or 0)
            self._preempt_one()

    def caught_up(self) -> bool:
        """Whether the fleet has trained a step since the last kill, restart or preemption (and at all).
        `--kill-every` and `--preempt-every` wait for it: the faults then hit a fleet that trains, and a
        machine however slow makes progress between two of them (a schedule by the clock alone outruns a
        fleet that needs longer to start or recover than its period: on a busy 2-core CI machine, a kill
        every 4 s kept a fleet at step 0 for 300 s)."""
        step_at = self.demo.progress.last_step_at
        return step_at is not None and (self.last_fault_at is None or step_at > self.last_fault_at)

    def all_happened(self) -> bool:
        """Every fault the plan asks for has happened (`--until-faults`): each kind of `kill_only`
        killed while the fleet trained (after its first step: a kill during the fleet's start proves
        little), each partition healed, a node preempted and its agent gone, every crash point fired."""
        p, faults = self.plan, self.log.faults
        if p.kill_every_s and not set(p.kill_only) <= self.killed_training:
            return False
        if p.preempt_every_s and (not self.leaving or any(c.returncode() is None for c in self.demo.children
                                                          if c.name in self.leaving)):
            return False
        if not {x.region for x in p.partitions} <= {f.target for f in faults if f.kind == "heal"}:
            return False
        if p.crash_at:
            self._look_for_crashes()
            return len(self.crashes) >= len(p.crash_at)
        return True

    def recovered(self) -> bool:
        """Stopped, nothing down or cut, and the trainer finished a step after the last restart or heal."""
        if not self.stopped or self.restarts or self.cut:
            return False
        last = max([*self.restarted_at.values(), *(self.log.started + f.t for f in self.log.faults
                                                    if f.kind == "heal")], default=0.0)
        step_at = self.demo.progress.last_step_at
        return step_at is not None and step_at > last

    def stop(self) -> None:
        """No new faults (the trainer is done); heal what is cut and restart what is down."""
        self.stopped = True
        for region in sorted(self.cut):
            self._heal(region)
        for name, (_, child) in list(self.restarts.items()):
            self._restart(name, child)

    # -- kill -----------------------------------------------------------------------------------

    def _targets(self) -> list[tuple[str, int, Child | None]]:
        """(name, pid, the Child to restart or None when its supervisor restarts it) of live processes."""
        d = self.demo
        out: list[tuple[str, int, Child | None]] = []
        for child in d.children:
            if child.returncode() is not None or child.name in self.leaving or child.name.startswith("fuzz"):
                continue
            out.append((child.name, child.pid, child))
            if child.name.startswith("agent-"):
                out += [(f"worker-{child.name[len('agent-'):]}", pid, None) for pid in _workers(child.pid)]
        if self.plan.durable:  # a memory broker loses its log when killed: only durable ones are fair game
            out += [(s.name, s.pid, s) for s in d.servers if s.name.startswith("tansu-") and s.returncode() is None]
        return out

    def _kill_one(self) -> None:
        """A random live process of the next kind in turn. Kinds take turns strictly, so each is hit at
        the same rate; when every process of the kind is still recovering from its last kill
        (`_recovered`) this turn kills nothing, rather than passing the kill to another kind (which
        would hit the brokers twice as often while a trainer restarts)."""
        kinds = self.plan.kill_only
        kind = kinds[self.kill_turn % len(kinds)]
        self.kill_turn += 1
        now = time.monotonic()
        of_kind = [t for t in self._targets() if _kind(t[0]) == kind and self._recovered(t[0], now)]
        if of_kind:
            name, pid, child = self.rng.choice(of_kind)
            self.kill(name, pid, child)

    def _recovered(self, name: str, now: float) -> bool:
        """Whether a process may be killed (again): `--recover` s after its restart, and a trainer only
        once the run has saved its first checkpoint and, after a restart, once it has checkpointed since,
        i.e. made progress a kill cannot take back (at most TRAINER_RECOVER_FACTOR x `--recover` s). A
        trainer killed after its first step but before its first checkpoint redoes that step: the kill
        would not have hit a fleet that trains."""
        trainer = _kind(name) == "trainer"
        if trainer and self.demo.progress.last_checkpoint_at is None:
            return False
        since = self.restarted_at.get(name)
        if since is None:
            return True
        if now - since < self.plan.recover_s:
            return False
        if trainer:
            saved = self.demo.progress.last_checkpoint_at
            return (saved is not None and saved > since) or now - since >= TRAINER_RECOVER_FACTOR * self.plan.recover_s
        return True

    def kill(self, name: str, pid: int, child: Child | None) -> None:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            return
        self._fault("kill", name, f"pid {pid}")
        if self.demo.progress.last_step_at is not None:
            self.killed_training.add(_kind(name))
        if child is not None:
            self.restarts[name] = (time.monotonic() + RESTART_S, child)
        else:  # a worker: its agent's supervisor restarts it; it recovers from now on
            self.restarted_at[name] = time.monotonic()

    def _restart_due(self, now: float) -> None:
        for name, (due, child) in list(self.restarts.items()):
            if now >= due:
                self._restart(name, child)

    def _restart(self, name: str, child: Child) -> None:
        if child.proc is not None:
            try:
                child.proc.wait(timeout=5)
            except Exception as exc:
                raise DemoError(f"{name} (pid {child.pid}) did not die after SIGKILL: {exc}") from exc
        child.restart()
        del self.restarts[name]
        self.restarted_at[name] = time.monotonic()
        self.demo.restarted(child)
        self._fault("restart", name, f"pid {child.pid}")

    # -- crash points ---------------------------------------------------------------------------

    def _look_for_crashes(self) -> None:
        """Record each crash point fired since the last look (a `crash` fault naming the point)."""
        if not self.plan.crash_at:
            return
        for kind in CRASH_KINDS:
            for m in crashpoints.fired(self.crash_dir / kind):
                marker = f"{kind}/{m['index']:02d}-{m['point']}"
                if marker not in self.crashes:
                    self.crashes[marker] = int(str(m.get("pid", -1)))
                    self._fault("crash", str(m["point"]), f"{kind} pid {m.get('pid')}")

    def _crashed(self, child: Child) -> bool:
        """Whether `child` SIGKILLed itself at a crash point (and so is to be restarted, not mourned)."""
        if child.returncode() != -signal.SIGKILL:
            return False
        self._look_for_crashes()
        return child.pid in self.crashes.values()

    def _crash_restarts(self) -> None:
        """Restart, after `RESTART_S`, every child killed at a crash point, as systemd's Restart= would
        (also once the run is stopping: a trainer may crash while it drains)."""
        self._look_for_crashes()
        for child in self.demo.children:
            if child.name not in self.restarts and self._crashed(child):
                self.restarts[child.name] = (time.monotonic() + RESTART_S, child)

    # -- preempt --------------------------------------------------------------------------------

    def _preempt_one(self) -> None:
        """Notice a random live agent whose worker is generating (holds groups it admitted): preempting a
        node that has not come up yet (its worker still importing torch and loading weights) tests
        nothing, and on a slow machine a schedule that keeps picking the newest nodes starves the fleet
        for good (CI's 2 cores: 30 s from an agent's start to its worker's first group); a worker that
        holds no group has nothing to hand over."""
        agents = [c for c in self.demo.children
                  if c.name.startswith("agent-") and c.returncode() is None and c.name not in self.leaving
                  and c.name not in self.restarts and self.demo.generating(c)]
        if not agents:
            return
        agent = self.rng.choice(agents)
        region, node = self.demo.agent_of(agent)
        notice = self.demo.notice_file(region, node)
        notice.write_text(f"preempted by fleetrl demo --preempt-every at {time.time():.1f}\n")
        self.leaving.add(agent.name)
        self._fault("preempt", agent.name, str(notice))
        self.replacements += 1
        new_node = f"{node.split('-r')[0]}-r{self.replacements}"
        replacement = self.demo.start_agent(region, new_node)
        self._fault("replace", replacement.name)

    # -- partitions -----------------------------------------------------------------------------

    def _partitions(self, t: float) -> None:
        for p in self.plan.partitions:
            if p.region in self.cut and t >= p.start_s + p.seconds:
                self._heal(p.region)
            elif not self.stopped and p.region not in self.cut and p.start_s <= t < p.start_s + p.seconds:
                links = self.demo.relays.cut(f"{p.region}/")
                self.cut.add(p.region)
                self._fault("partition", p.region, f"{p.seconds:g} s: {', '.join(links)}")

    def _heal(self, region: str) -> None:
        self.demo.relays.heal(f"{region}/")
        self.cut.discard(region)
        self._fault("heal", region)


def _kind(name: str) -> str:
    """trainer, agent, worker, replicator or broker, from a process's name in the demo."""
    head = name.split("-", 1)[0]
    return "broker" if head == "tansu" else head


def _workers(agent_pid: int) -> list[int]:
    """PIDs of an agent's rollout worker processes."""
    try:
        kids = psutil.Process(agent_pid).children()
    except psutil.Error:
        return []
    out = []
    for kid in kids:
        try:
            if "fleetrl.rollout" in " ".join(kid.cmdline()):
                out.append(kid.pid)
        except psutil.Error:
            continue
    return out
