"""The collector: decides what happens to each finished group that arrives (DESIGN.md §3, §6).

Every group of this run that the broker's consumer decoded and bounds-checked (it dead-letters the
rest itself) gets exactly one verdict:

* `accepted`  - buffered until the learner takes it for a step;
* `duplicate` - its `group_id` was already trained, dropped or buffered (a redelivery after a
  restart, or a second attempt after a redispatch): a group trains at most once;
* `stale`     - its oldest token is more than `max_staleness + 1` versions behind the learner;
  dropped and counted (a metric), and remembered so that a later copy is a duplicate (behind: in
  optimizer steps along the weights' lineage, see `Collector.lag_of`);
* `foreign`   - a record of another run (dead-lettered by the trainer with that reason).

The ledger of settled groups (`ledger.py`: trained once or dropped stale, the newest in detail,
older ones folded into ranges of group indices) goes into every checkpoint with the buffer, so
after a restart `fleetrl audit` can prove from the topics and the checkpoint that every dispatched
group was trained once, reading each `prompts` partition only from the ledger's settled watermark.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any, Literal

from fleetrl.broker import GroupRecord, decode_record, encode_record
from fleetrl.trainer.ledger import Ledger, TrainedEntry

Verdict = Literal["accepted", "duplicate", "stale", "foreign"]

__all__ = ["Collector", "TrainedEntry", "Verdict"]


class Collector:
    def __init__(self, run: str, max_staleness: int, ledger_detail_groups: int = 1024) -> None:
        self.run = run
        self.max_lag = max_staleness + 1
        self.ledger = Ledger(run, ledger_detail_groups)
        self.pending: OrderedDict[str, GroupRecord] = OrderedDict()
        self.in_step: dict[str, GroupRecord] = {}
        """Groups taken for the step now running (`take`), until it is marked trained or they are given
        back: still resolved, so a copy of one arriving meanwhile (a redelivery) is a duplicate."""
        self.duplicates = 0
        self._made_with: dict[str, int] = {}
        """`GroupRecord.min_version` of each buffered or running group, taken once: it scans every token
        of every sample, and the bound asks for it at arrival, at `take` and at `mark_trained`."""
        self.republished: list[tuple[int, int]] = []
        """(version, checkpoint version) of each republish, oldest first: `version` holds the very
        weights of `checkpoint version` (a restarted trainer's checkpoint, published again as the
        store's next version), and the versions between them were published from weights now lost."""

    @property
    def trained(self) -> list[TrainedEntry]:
        """The newest trained groups in detail (older ones are folded: `ledger.trained_count`)."""
        return self.ledger.trained

    @property
    def stale(self) -> dict[str, dict[str, Any]]:
        """The newest stale groups in detail (`ledger.stale_count` counts them all)."""
        return self.ledger.stale

    def is_resolved(self, gid: str) -> bool:
        return gid in self.pending or gid in self.in_step or self.ledger.settled(gid)

    def lag(self, record: GroupRecord, version: int) -> int:
        made_with = self._made_with.get(record.group_id)
        return self.lag_of(record.min_version if made_with is None else made_with, version)

    def lag_of(self, made_with: int, version: int) -> int:
        """Optimizer steps between the weights of version `made_with` and those of `version`, along
        the weights' lineage: a republished version counts as its checkpoint's weights (0 steps), and a
        version published after that checkpoint by a trainer that died (its weights lost) is as many
        steps off the checkpoint as it was ahead of it. Without republishes, `version - made_with`."""
        steps = 0
        for published, ckpt in reversed(self.republished):
            if published > version:
                continue  # a republish later than `version` (only when asked about the past)
            if made_with >= published:
                break
            steps += version - published
            if made_with > ckpt:  # on the lost branch after the checkpoint
                return steps + made_with - ckpt
            version = ckpt
        return steps + version - made_with

    def note_republished(self, version: int, checkpoint_version: int) -> None:
        """`version` was published with the weights of `checkpoint_version` (a restart's republish)."""
        if version <= checkpoint_version or (self.republished and version <= self.republished[-1][0]):
            raise ValueError(f"republished version {version} must follow checkpoint version {checkpoint_version} "
                             f"and every earlier republish {self.republished[-1:]}")
        self.republished.append((version, checkpoint_version))

    def offer(self, record: GroupRecord, version: int) -> Verdict:
        if record.run != self.run:
            return "foreign"
        if self.is_resolved(record.group_id):
            self.duplicates += 1
            return "duplicate"
        self._made_with[record.group_id] = record.min_version
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
                self.in_step[gid] = record
        return batch, dropped

    def ready(self, n: int) -> bool:
        return len(self.pending) >= n

    def give_back(self, groups: list[GroupRecord]) -> None:
        """Put groups taken for a step that did not happen back at the front of the buffer."""
        for record in reversed(groups):
            self.in_step.pop(record.group_id, None)
            self.pending[record.group_id] = record
            self.pending.move_to_end(record.group_id, last=False)

    def mark_trained(self, groups: list[GroupRecord], step: int, version: int) -> None:
        for g in groups:
            self.in_step.pop(g.group_id, None)
            self.ledger.add_trained(TrainedEntry(g.group_id, g.attempt, g.region, step, version, self.lag(g, version)))
            self._made_with.pop(g.group_id, None)

    def note_dispatched(self, gid: str, region: str, partition: int, offset: int) -> None:
        """Where the prompt record of `gid` landed (the audit's settled watermark needs it)."""
        self.ledger.note_dispatched(gid, region, partition, offset)

    def _drop_stale(self, record: GroupRecord, version: int) -> None:
        self.ledger.add_stale(record.group_id, {"attempt": record.attempt, "region": record.region,
                                                "lag": self.lag(record, version), "version": version})
        self._made_with.pop(record.group_id, None)

    # -- checkpoint ---------------------------------------------------------------------------

    def state(self) -> dict[str, Any]:
        ledger = self.ledger.state()  # folds first: the detail rows below are what is left
        return {
            "trained": [[e.group_id, e.attempt, e.region, e.step, e.version, e.lag] for e in self.trained],
            "stale": self.stale,
            "ledger": ledger,
            "pending": [encode_record(r) for r in self.pending.values()],
            "duplicates": self.duplicates,
            "republished": [list(pair) for pair in self.republished],
        }

    def restore(self, state: dict[str, Any], drawn: int = 0) -> None:
        """Continue after `state`; `drawn` is the dispatcher's count of prompts drawn by then (for
        a checkpoint written before the ledger kept prompt positions)."""
        self.ledger.restore(state["trained"], state["stale"], state.get("ledger"), drawn)
        self.pending = OrderedDict()
        for raw in state["pending"]:
            record = decode_record(raw)
            assert isinstance(record, GroupRecord)
            self.pending[record.group_id] = record
        self.duplicates = int(state.get("duplicates", 0))
        self.republished = [(int(v), int(c)) for v, c in state.get("republished", [])]
