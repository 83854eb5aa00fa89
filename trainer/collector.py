"""The collector: decides what happens to each finished group that arrives (DESIGN.md §3, §6).

Every group of this run that the broker's consumer decoded and bounds-checked (it dead-letters the
rest itself) gets exactly one verdict:

* `accepted`  - buffered until the learner takes it for a step;
* `duplicate` - its `group_id` was already trained, dropped or buffered (a redelivery after a
  restart, or a second attempt after a redispatch): a group trains at most once;
* `stale`     - its oldest token is more than `max_staleness + 1` versions behind the learner;
  dropped and counted (a metric), and remembered so that a later copy is a duplicate;
* `foreign`   - a record of another run (dead-lettered by the trainer with that reason).

The ledger of trained groups (group, attempt, region, step) is append-only and goes into every
checkpoint with the buffer, so after a restart `fleetrl audit` can prove from the topics and the
checkpoint that every dispatched group was trained once.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Literal

from fleetrl.broker import GroupRecord, decode_record, encode_record

Verdict = Literal["accepted", "duplicate", "stale", "foreign"]


@dataclass(slots=True)
class TrainedEntry:
    group_id: str
    attempt: int
    region: str
    step: int
    version: int
    lag: int


class Collector:
    def __init__(self, run: str, max_staleness: int) -> None:
        self.run = run
        self.max_lag = max_staleness + 1
        self.trained: list[TrainedEntry] = []
        self.stale: dict[str, dict[str, Any]] = {}
        self.pending: OrderedDict[str, GroupRecord] = OrderedDict()
        self._trained_ids: set[str] = set()
        self.duplicates = 0

    def is_resolved(self, gid: str) -> bool:
        return gid in self._trained_ids or gid in self.stale or gid in self.pending

    def lag(self, record: GroupRecord, version: int) -> int:
        return version - record.min_version

    def offer(self, record: GroupRecord, version: int) -> Verdict:
        if record.run != self.run:
            return "foreign"
        if self.is_resolved(record.group_id):
            self.duplicates += 1
            return "duplicate"
        if self.lag(record, version) > self.max_lag:
            self._drop_stale(record, version)
            return "stale"
        self.pending[record.group_id] = record
        return "accepted"

    def take(self, n: int, version: int) -> tuple[list[GroupRecord], list[GroupRecord]]:
        """Up to `n` buffered groups still within the bound, oldest first, and those now too stale."""
        batch: list[GroupRecord] = []
        dropped: list[GroupRecord] = []
        for gid in list(self.pending):
            if len(batch) == n:
                break
            record = self.pending.pop(gid)
            if self.lag(record, version) > self.max_lag:
                self._drop_stale(record, version)
                dropped.append(record)
            else:
                batch.append(record)
        return batch, dropped

    def ready(self, n: int) -> bool:
        return len(self.pending) >= n

    def give_back(self, groups: list[GroupRecord]) -> None:
        """Put groups taken for a step that did not happen back at the front of the buffer."""
        for record in reversed(groups):
            self.pending[record.group_id] = record
            self.pending.move_to_end(record.group_id, last=False)

    def mark_trained(self, groups: list[GroupRecord], step: int, version: int) -> None:
        for g in groups:
            assert g.group_id not in self._trained_ids, f"group {g.group_id} trained twice"
            self._trained_ids.add(g.group_id)
            self.trained.append(TrainedEntry(g.group_id, g.attempt, g.region, step, version, self.lag(g, version)))

    def _drop_stale(self, record: GroupRecord, version: int) -> None:
        self.stale[record.group_id] = {"attempt": record.attempt, "region": record.region,
                                       "lag": self.lag(record, version), "version": version}

    # -- checkpoint ---------------------------------------------------------------------------

    def state(self) -> dict[str, Any]:
        return {
            "trained": [[e.group_id, e.attempt, e.region, e.step, e.version, e.lag] for e in self.trained],
            "stale": self.stale,
            "pending": [encode_record(r) for r in self.pending.values()],
            "duplicates": self.duplicates,
        }

    def restore(self, state: dict[str, Any]) -> None:
        self.trained = [TrainedEntry(*row) for row in state["trained"]]
        self._trained_ids = {e.group_id for e in self.trained}
        self.stale = dict(state["stale"])
        self.pending = OrderedDict()
        for raw in state["pending"]:
            record = decode_record(raw)
            assert isinstance(record, GroupRecord)
            self.pending[record.group_id] = record
        self.duplicates = int(state.get("duplicates", 0))
