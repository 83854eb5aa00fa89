"""The trainer's eval books: every evaluation scheduled, each prompt's dispatch and return (DESIGN.md §12).

An evaluation is one eval set at one pinned version. Its prompts are groups with ids
`<run>-eval-<set>-<version>-<index>` (never `<run>-<index>`: the training ledger, its folding and the
audit's training books never see them). A `fleetrl eval` run on the fleet (fleetrl/eval_fleet.py) names
its request in its ids, `<run>-evalreq-<request>-<set>-<version>-<index>`: its groups are its own, and the
trainer, which did not schedule them, skips them (counted in `foreign`).
A prompt is dispatched (attempt 0, and a new attempt each time it is re-sent), and returned once: the
first group that comes back counts, a later copy is a duplicate; or a worker dead-letters it
(`eval_dead.py`). An evaluation is complete (settled) when every prompt has returned or was dead-lettered;
its figures, over the prompts that returned, are then final.

The books are plain data and go into every checkpoint (`state` / `restore`), so `fleetrl audit` can
prove from the topics and the checkpoint that every eval prompt dispatched was returned once or is
still in flight, and a restarted trainer continues the evaluations it had scheduled.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from fleetrl.trainer.eval_figures import EvalFigures, ReturnedGroup, figures


def _prefix(run: str, request: str | None) -> str:
    return f"{run}-eval-" if request is None else f"{run}-evalreq-{request}-"


def eval_group_id(run: str, set_name: str, version: int, index: int, request: str | None = None) -> str:
    """The trainer's eval group id (`request` None), or that of a `fleetrl eval` request."""
    return f"{_prefix(run, request)}{set_name}-{version:09d}-{index:06d}"


def eval_request_of(gid: str, run: str) -> str | None:
    """The request a `fleetrl eval` group id of `run` names; None for any other id (the trainer's among them)."""
    prefix = f"{run}-evalreq-"
    request = gid[len(prefix):].partition("-")[0] if gid.startswith(prefix) else ""
    return request if request and parse_eval_group_id(gid, run, request) is not None else None


def parse_eval_group_id(gid: str, run: str, request: str | None = None) -> tuple[str, int, int] | None:
    """(set, version, index) of an eval group id of `run` (of `request`, or the trainer's when None), or
    None for any other id."""
    prefix = _prefix(run, request)
    if not gid.startswith(prefix):
        return None
    head, _, index = gid[len(prefix):].rpartition("-")
    set_name, _, version = head.rpartition("-")
    if not (set_name and version.isdigit() and version.isascii() and index.isdigit() and index.isascii()):
        return None
    return set_name, int(version), int(index)


@dataclass(slots=True)
class Flight:
    region: str
    attempt: int
    dispatched_at: float
    sent: bool = True


@dataclass(slots=True)
class Evaluation:
    """One eval set at one pinned version."""

    set_name: str
    version: int
    step: int
    """The trainer step that published the version (0: the version training started from)."""
    prompts: int
    next_index: int = 0
    """Prompts dispatched so far (in index order)."""
    in_flight: dict[int, Flight] = field(default_factory=dict)
    returned: dict[int, ReturnedGroup] = field(default_factory=dict)
    resent: int = 0
    duplicates: int = 0
    dead: list[int] = field(default_factory=list)
    """Prompts a worker dead-lettered (they cannot return): the evaluation ends without them, its figures
    over the prompts that returned."""
    row: dict[str, Any] | None = None
    """The figures, once complete."""

    @property
    def key(self) -> tuple[str, int]:
        return self.set_name, self.version

    @property
    def complete(self) -> bool:
        return len(self.returned) == self.prompts

    @property
    def settled(self) -> bool:
        """Nothing more can come: every prompt returned or dead-lettered."""
        return len(self.returned) + len(self.dead) >= self.prompts

    def measure(self, k: int, pass_threshold: float) -> EvalFigures:
        return figures(self.set_name, self.version, [self.returned[i] for i in sorted(self.returned)], k,
                       pass_threshold)

    def state(self) -> dict[str, Any]:
        return {"set": self.set_name, "version": self.version, "step": self.step, "prompts": self.prompts,
                "next_index": self.next_index,
                "in_flight": [[i, f.region, f.attempt, f.dispatched_at, f.sent] for i, f in self.in_flight.items()],
                "returned": [[i, g.state()] for i, g in sorted(self.returned.items())],
                "resent": self.resent, "duplicates": self.duplicates, "dead": list(self.dead), "row": self.row}

    @classmethod
    def from_state(cls, s: dict[str, Any]) -> Evaluation:
        return cls(str(s["set"]), int(s["version"]), int(s["step"]), int(s["prompts"]), int(s["next_index"]),
                   {int(i): Flight(str(r), int(a), float(t), bool(sent)) for i, r, a, t, sent in s["in_flight"]},
                   {int(i): ReturnedGroup.from_state(g) for i, g in s["returned"]},
                   int(s.get("resent", 0)), int(s.get("duplicates", 0)), [int(i) for i in s.get("dead", [])],
                   s.get("row"))


class EvalBook:
    """Every evaluation of the run, oldest first."""

    def __init__(self, run: str) -> None:
        self.run = run
        self.evals: dict[tuple[str, int], Evaluation] = {}
        self.orphans = 0
        """Eval groups of evaluations this book does not hold (scheduled by a trainer that died before
        its checkpoint): not lost, and not measured."""
        self.foreign = 0
        """Eval groups of `fleetrl eval` requests (`eval_request_of`): someone else's, skipped."""

    def schedule(self, set_name: str, version: int, step: int, prompts: int) -> Evaluation | None:
        """A new evaluation; None when this set at this version is scheduled already."""
        if (set_name, version) in self.evals:
            return None
        ev = Evaluation(set_name, version, step, prompts)
        self.evals[ev.key] = ev
        return ev

    def unfinished(self) -> list[Evaluation]:
        return [e for e in self.evals.values() if not e.settled]

    def in_flight(self) -> int:
        return sum(len(e.in_flight) for e in self.evals.values())

    def pinned_versions(self) -> set[int]:
        """Versions an unfinished evaluation still needs from the hub."""
        return {e.version for e in self.unfinished()}

    def on_return(self, set_name: str, version: int, index: int, group: ReturnedGroup) -> Evaluation | None:
        """A group came back; the evaluation when this made it complete, else None."""
        ev = self.evals.get((set_name, version))
        if ev is None or index >= ev.prompts:
            self.orphans += 1
            return None
        if index in ev.returned:
            ev.duplicates += 1
            return None
        ev.in_flight.pop(index, None)
        if index in ev.dead:  # an attempt sent again came back after all
            ev.dead.remove(index)
        ev.returned[index] = group
        return ev if ev.settled else None

    def on_dead(self, set_name: str, version: int, index: int, attempt: int) -> Evaluation | None:
        """A worker dead-lettered attempt `attempt` of a prompt; the evaluation when this settled it, else
        None. A dead letter of an attempt older than the one in flight changes nothing (the new one may return)."""
        ev = self.evals.get((set_name, version))
        if ev is None or index >= ev.next_index or index in ev.returned or index in ev.dead:
            return None
        flight = ev.in_flight.get(index)
        if flight is not None and flight.attempt > attempt:
            return None
        ev.in_flight.pop(index, None)
        ev.dead.append(index)
        return ev if ev.settled else None

    def rows(self) -> list[dict[str, Any]]:
        return [e.row for e in self.evals.values() if e.row is not None]

    def state(self) -> dict[str, Any]:
        return {"evals": [e.state() for e in self.evals.values()], "orphans": self.orphans, "foreign": self.foreign}

    def restore(self, state: dict[str, Any] | None) -> None:
        state = state or {}
        self.evals = {}
        for s in state.get("evals", []):
            ev = Evaluation.from_state(s)
            self.evals[ev.key] = ev
        self.orphans = int(state.get("orphans", 0))
        self.foreign = int(state.get("foreign", 0))
