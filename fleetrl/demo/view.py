"""What `fleetrl demo` shows: progress read from its children's JSON log events.

Every daemon logs JSON events to its file under `<workdir>/logs/`; `LogTail` reads the new complete
lines of each file, `Progress` folds the events into the figures on screen and in the summary. The
logs are the most robust source here: they need no connection, survive a child's crash, and hold
exactly what the daemons did (the events are documented in docs/trainer.md, docs/hub.md and
docs/regions.md):

    trainer     step.done (step, version, reward_mean, reward_std, lag_mean, lag_max, groups, tokens,
                cost_usd_* and the other running cost totals when the fleet is priced),
                weights.published (version, anchor, bytes), group.stale, eval.done (set, version, step,
                pass@1, pass@k, reward_mean, length_mean, ...: one evaluation's figures, docs/eval.md)
    replicator  replicator.copied (version, region, source, bytes)
    agent       worker.started, worker.admitted, worker.group_done, worker.handed_over (group_id),
                worker.released (group_ids), agent.state (state)
"""

from __future__ import annotations

import json
import pathlib
import time
from collections import deque
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from rich.console import Console
from rich.live import Live
from rich.table import Table

_RATE_WINDOW_S = 10.0  # groups/s is measured over this trailing window
COST_FIELDS = ("cost_usd_total", "cost_usd_on_demand", "cost_usd_spot", "tokens_sampled_total", "groups_resent_total",
               "tokens_regenerated_total", "node_s_total", "serving_s_total")
"""The running cost totals a priced trainer's `step.done` carries (trainer/cost.py)."""
_SPARK_STEPS = 40  # the reward curve on screen shows this many recent steps
_BARS = "▁▂▃▄▅▆▇█"


class LogTail:
    """The JSON events appended to one log file since the last read (partial lines wait)."""

    def __init__(self, path: pathlib.Path) -> None:
        self.path, self._offset, self._rest = path, 0, b""

    def events(self) -> Iterator[dict[str, Any]]:
        try:
            with open(self.path, "rb") as f:
                f.seek(self._offset)
                chunk = f.read()
        except FileNotFoundError:
            return
        self._offset += len(chunk)
        *lines, self._rest = (self._rest + chunk).split(b"\n")
        for line in lines:
            if line.startswith(b"{"):
                try:
                    event = json.loads(line)
                except ValueError:
                    continue  # a line that merely starts like JSON (a child's stray print)
                if isinstance(event, dict):
                    yield event


@dataclass
class RegionView:
    nodes: dict[str, str] = field(default_factory=dict)
    """Node name -> its last state (`starting` until the agent says otherwise)."""
    generating: set[str] = field(default_factory=set)
    """Nodes whose worker has loaded its weights and taken work (`worker.started`)."""
    holding: dict[str, set[str]] = field(default_factory=dict)
    """Node -> the groups its worker admitted (`worker.admitted`) and has neither finished
    (`worker.group_done`), handed over (`worker.handed_over`) nor released to another member
    (`worker.released`); emptied when a worker (re)starts."""
    groups_done: int = 0
    done_at: deque[float] = field(default_factory=deque)
    replica_version: int | None = None
    copies: int = 0
    copy_bytes: int = 0
    sources: dict[str, int] = field(default_factory=dict)
    """Store a version was copied from -> how many times (home, or a peer region)."""

    def groups_per_s(self, now: float) -> float:
        while self.done_at and now - self.done_at[0] > _RATE_WINDOW_S:
            self.done_at.popleft()
        return len(self.done_at) / _RATE_WINDOW_S


@dataclass
class Progress:
    target_steps: int
    regions: dict[str, RegionView]
    rewards: list[float] = field(default_factory=list)
    step: int = 0
    version: int | None = None
    published: dict[int, tuple[int, int]] = field(default_factory=dict)
    """Version -> (bytes written, anchor version)."""
    started: float = field(default_factory=time.monotonic)
    steps: dict[int, dict[str, Any]] = field(default_factory=dict)
    """Step -> its row of metrics.jsonl (a step redone after a trainer restart replaces the row)."""
    stale_dropped: int = 0
    last_step_at: float | None = None
    """When (monotonic) the trainer last finished a step."""
    last_checkpoint_at: float | None = None
    """When (monotonic) the trainer last saved a checkpoint."""
    faults: list[Any] = field(default_factory=list)
    """The injected faults (`fleetrl.demo.chaos.Fault`), shown as they happen."""
    evals: dict[tuple[str, int], dict[str, Any]] = field(default_factory=dict)
    """(eval set, version) -> its figures (`eval.done`), in the order they completed."""
    evals_scheduled: set[tuple[str, int]] = field(default_factory=set)
    """(eval set, version) of every `eval.scheduled`: those not in `evals` are still out."""
    _printed: list[str] = field(default_factory=list)

    def on_fault(self, fault: Any) -> None:
        """A fault was injected: one line in plain output (the live table lists the recent ones)."""
        self._printed.append(f"fault at {fault.t:.0f} s: {fault.kind} {fault.target}")

    def pop_lines(self) -> list[str]:
        out, self._printed = self._printed, []
        return out

    def feed(self, event: dict[str, Any], agent: tuple[str, str] | None = None) -> str | None:
        """Fold one event in (`agent`: region and node of the agent that logged it); returns a line
        worth printing, if any."""
        name = event.get("event")
        if name == "step.done":
            self.step, self.version = int(event["step"]), int(event["version"])
            del self.rewards[self.step - 1:]  # a restarted trainer redoes the steps after its checkpoint
            self.rewards.append(float(event["reward_mean"]))
            self.steps[self.step] = self._row(event)
            self.last_step_at = time.monotonic()
            return self.step_line()
        if name == "trainer.started":
            # A restarted trainer goes on from its checkpoint: the steps a killed one made after that are
            # gone from the model (it redoes them), so they leave the view, the summary and metrics.jsonl.
            self.step = int(event.get("step") or 0)
            del self.rewards[self.step:]
            for redone in [s for s in self.steps if s > self.step]:
                del self.steps[redone]
        if name == "checkpoint.saved":
            self.last_checkpoint_at = time.monotonic()
        if name == "eval.scheduled":
            self.evals_scheduled.add((str(event["set"]), int(event["version"])))
        if name == "eval.done":
            row = {k: v for k, v in event.items() if k not in ("event", "level", "timestamp", "component")}
            self.evals[(str(event["set"]), int(event["version"]))] = row
            return f"eval {event['set']} at version {event['version']}: pass@1 {float(event['pass@1']):.3f}"
        if name == "group.stale":
            self.stale_dropped += 1
        if name == "weights.published":
            self.published[int(event["version"])] = (int(event["bytes"]), int(event["anchor"]))
            self.version = max(self.version or 0, int(event["version"]))
        elif name == "replicator.copied" and event.get("region") in self.regions:
            r = self.regions[event["region"]]
            r.replica_version = max(r.replica_version or 0, int(event["version"]))
            r.copies, r.copy_bytes = r.copies + 1, r.copy_bytes + int(event["bytes"])
            r.sources[str(event["source"])] = r.sources.get(str(event["source"]), 0) + 1
        elif agent is not None:
            self._agent_event(agent, name, event)
        return None

    def _agent_event(self, agent: tuple[str, str], name: Any, event: dict[str, Any]) -> None:
        region, node = agent
        view = self.regions.get(region)
        if view is None:
            return
        if name == "worker.group_done":
            view.groups_done += 1
            view.done_at.append(time.monotonic())
            view.holding.get(node, set()).discard(str(event.get("group_id")))
        elif name == "worker.admitted":
            view.holding.setdefault(node, set()).add(str(event.get("group_id")))
        elif name == "worker.handed_over":
            view.holding.get(node, set()).discard(str(event.get("group_id")))
        elif name == "worker.released":  # admitted, then given up to another member by a rebalance
            view.holding.get(node, set()).difference_update(str(g) for g in event.get("group_ids") or ())
        elif name == "agent.state":
            view.nodes[node] = str(event["state"])
        elif name == "worker.started":
            view.nodes[node] = "up"
            view.generating.add(node)
            view.holding[node] = set()  # a restarted worker holds nothing its predecessor admitted

    def _row(self, e: dict[str, Any]) -> dict[str, Any]:
        now = time.monotonic()
        return {
            "step": self.step, "version": self.version, "t": round(now - self.started, 2),
            "reward_mean": e.get("reward_mean"), "reward_std": e.get("reward_std"),
            "staleness_mean": e.get("lag_mean"), "staleness_max": e.get("lag_max"), "groups": e.get("groups"),
            "stale_dropped": self.stale_dropped,
            "bytes_published": sum(b for b, _ in self.published.values()),
            "wan_copies": sum(r.copies for r in self.regions.values()),
            "regions": {n: {"groups_per_s": round(r.groups_per_s(now), 3), "groups_done": r.groups_done,
                            "replica_lag": None if r.replica_version is None else self.step - r.replica_version}
                        for n, r in self.regions.items()},
            "faults": sum(1 for f in self.faults if f.kind in ("kill", "preempt", "partition")),
            "tokens": e.get("tokens"),
            **{k: e[k] for k in COST_FIELDS if k in e},
        }

    def metric_rows(self) -> list[dict[str, Any]]:
        return [self.steps[k] for k in sorted(self.steps)]

    def eval_rows(self) -> list[dict[str, Any]]:
        """One row per evaluated (set, version), by version: `summary.json`'s `eval`."""
        return [self.evals[k] for k in sorted(self.evals, key=lambda k: (k[1], k[0]))]

    def eval_label(self) -> str:
        """The last evaluation's pass@1, for the view's title and step lines ("" before the first)."""
        if not self.evals:
            return ""
        last = next(reversed(self.evals.values()))
        return f"  eval {last['set']} pass@1 {float(last['pass@1']):.3f} (v{last['version']})"

    def step_line(self) -> str:
        now = time.monotonic()
        regions = "  ".join(f"{n}: {r.groups_per_s(now):.1f} groups/s, replica v{_v(r.replica_version)}"
                            for n, r in self.regions.items())
        return (f"step {self.step}/{self.target_steps}  reward {self.rewards[-1]:.3f}  version {self.version}  "
                f"{regions}{self.eval_label()}  ({now - self.started:.0f} s)")

    def holding_latest(self) -> list[str]:
        return [n for n, r in self.regions.items()
                if self.version is not None and r.replica_version is not None and r.replica_version >= self.version]

    def table(self) -> Table:
        now = time.monotonic()
        reward = f"{self.rewards[-1]:.3f}" if self.rewards else "-"
        first = f" (first {self.rewards[0]:.3f})" if len(self.rewards) > 1 else ""
        table = Table(title=f"fleetrl demo: step {self.step}/{self.target_steps}, reward {reward}{first} "
                            f"{sparkline(self.rewards[-_SPARK_STEPS:])}, policy version "
                            f"{self.version if self.version is not None else '-'},{self.eval_label()[1:]}"
                            f"{',' if self.evals else ''} {now - self.started:.0f} s",
                      title_justify="left")
        if self.faults:
            recent = ", ".join(f"{f.t:.0f}s {f.kind} {f.target}" for f in self.faults[-4:])
            table.caption = f"faults: {sum(1 for f in self.faults if f.kind != 'restart')} ({recent})"
            table.caption_justify = "left"
        for col in ("region", "nodes", "groups done", "groups/s", "replica version", "WAN copies"):
            table.add_column(col)
        for name, r in self.regions.items():
            latest = r.replica_version is not None and self.version is not None and r.replica_version >= self.version
            replica = "-" if r.replica_version is None else f"{r.replica_version}{' (latest)' if latest else ''}"
            table.add_row(name, " ".join(f"{n}:{s}" for n, s in sorted(r.nodes.items())), str(r.groups_done),
                          f"{r.groups_per_s(now):.1f}", replica, f"{r.copies} ({r.copy_bytes / 1e6:.2f} MB)")
        return table


def _v(version: int | None) -> str:
    return "-" if version is None else str(version)


def sparkline(values: list[float]) -> str:
    """Rewards as a row of block characters: the learning curve at a glance (full height: 0.5, or the
    best reward once it is higher)."""
    top = max([0.5, *values])
    return "".join(_BARS[min(len(_BARS) - 1, max(0, int(v / top * len(_BARS))))] for v in values)


@contextmanager
def live_display(console: Console, progress: Progress) -> Iterator[Live | None]:
    """`progress`'s table, redrawn in place on a terminal; None on a pipe or a file (the caller prints
    one plain line per step instead)."""
    if not console.is_terminal:
        yield None
        return
    with Live(progress.table(), console=console, refresh_per_second=4) as live:
        yield live
