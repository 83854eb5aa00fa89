"""The collector's ledger of settled groups, bounded in size (issue 12 part 3, issue 17 part 3).

A group is *settled* once it is trained (exactly once) or dropped stale. The ledger answers "is this
group settled?" for the collector's dedup forever, and goes into every checkpoint so that
`fleetrl audit` can prove exactly-once. One row per group forever would make a million-group run's
checkpoints hundreds of MB, so the ledger has two layers:

* detail: the newest `detail_groups` trained rows (group, attempt, region, step, version, lag) and
  as many stale ones, as before;
* folded: older settled groups of the dispatcher's id form `<run>-<index>`, kept only as their
  index in a set of `[lo, hi)` ranges plus the trained and stale counts. Groups settle almost in
  index order, so the set is a handful of ranges; a group that never settles (its trajectory
  dead-lettered, still in flight) costs one range boundary, not a row per later group.

The settled watermark per partition: the trainer tells the ledger where each prompt record it
produced landed (region, partition, offset) while the group is not folded. Per `prompts`
partition, everything below the watermark is a prompt record of a folded (settled) group, or a
record whose group has another record at or after it; `fleetrl audit` reads the topics from the
watermarks on, so Kafka retention may delete what lies below them. The watermark is the offset of
the partition's oldest record of a group not yet folded, or, with none, the end of what the trainer
produced there; it never moves back. After resuming a checkpoint written before the ledger had
positions (checkpoint format 1), no watermark is given until every group drawn before that resume
is folded: the older records' places are unknown.

A trainer killed after its checkpoint may have produced prompt records the checkpoint does not
know of; the restarted trainer trains those groups when their trajectories arrive, without sending
their prompts again. Such a group is "unplaced": nobody knows where its record lies. It is folded at
once, however new (`fold` folds every unplaced group, and watermarks are taken only after a fold):
below a watermark only folded groups' records may lie, so a folded group's record needs no place,
and the audit counts the group as trained without looking for it. (Holding every watermark at the
resumed checkpoint's ends until the group was folded in its turn, as before, kept them there for
good when the trainer restarted before `detail_groups` newer groups settled: the 20-minute soak,
trainer killed every ~75 s, had its audit read almost all of `prompts`.)
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from fleetrl.trainer.errors import CheckpointError


@dataclass(slots=True)
class TrainedEntry:
    group_id: str
    attempt: int
    region: str
    step: int
    version: int
    lag: int


def group_index(gid: str, run: str) -> int | None:
    """The prompt index in a dispatcher group id `<run>-<index>`, or None for any other id."""
    prefix = f"{run}-"
    tail = gid[len(prefix):]
    if not gid.startswith(prefix) or not tail.isdigit() or not tail.isascii():
        return None
    return int(tail)


class IndexRanges:
    """A set of non-negative integers as sorted, disjoint, non-touching `[lo, hi)` ranges."""

    def __init__(self) -> None:
        self._lo: list[int] = []
        self._hi: list[int] = []
        self._count = 0

    def __contains__(self, i: int) -> bool:
        k = bisect_right(self._lo, i) - 1
        return k >= 0 and i < self._hi[k]

    def __len__(self) -> int:
        return self._count

    def add(self, i: int) -> bool:
        """Add `i`; False when it was there already."""
        k = bisect_right(self._lo, i) - 1
        if k >= 0 and i < self._hi[k]:
            return False
        joins_left = k >= 0 and self._hi[k] == i
        joins_right = k + 1 < len(self._lo) and self._lo[k + 1] == i + 1
        if joins_left and joins_right:
            self._hi[k] = self._hi.pop(k + 1)
            self._lo.pop(k + 1)
        elif joins_left:
            self._hi[k] = i + 1
        elif joins_right:
            self._lo[k + 1] = i
        else:
            self._lo.insert(k + 1, i)
            self._hi.insert(k + 1, i + 1)
        self._count += 1
        return True

    def covers_below(self, n: int) -> bool:
        """Every integer in `[0, n)` is in the set."""
        return n <= 0 or (bool(self._lo) and self._lo[0] == 0 and self._hi[0] >= n)

    def rows(self) -> list[list[int]]:
        return [[lo, hi] for lo, hi in zip(self._lo, self._hi, strict=True)]

    @classmethod
    def from_rows(cls, rows: Iterable[Iterable[int]]) -> IndexRanges:
        """Rebuild from `rows()`; ValueError if they are not sorted, disjoint, non-empty ranges."""
        out, last = cls(), -1
        for row in rows:
            lo, hi = (int(x) for x in row)
            if lo < 0 or hi <= lo or lo <= last:
                raise ValueError(f"range [{lo}, {hi}) is empty, negative, or overlaps or touches the one before")
            out._lo.append(lo)
            out._hi.append(hi)
            out._count += hi - lo
            last = hi
        return out


Position = tuple[str, int, int]
"""(region, partition, offset) of one prompt record."""


class Ledger:
    def __init__(self, run: str, detail_groups: int = 1024) -> None:
        self.run, self.detail_groups = run, detail_groups
        self.trained: list[TrainedEntry] = []
        """Detail rows, oldest first."""
        self.stale: dict[str, dict[str, Any]] = {}
        """Detail rows of stale groups, oldest first."""
        self.folded = IndexRanges()
        self.folded_trained = 0
        self.folded_stale = 0
        self._trained_ids: set[str] = set()
        self.positions: dict[str, list[Position]] = {}
        """Prompt records of every group neither folded nor stale whose place the trainer knows (the audit
    checks that a detailed trained row was dispatched, so those records stay above the watermark)."""
        self.ends: dict[str, dict[int, int]] = {}
        """region -> partition -> offset after the newest prompt record the trainer produced there."""
        self.watermarks: dict[str, dict[int, int]] = {}
        self.blind_below = 0
        """Groups below this index were drawn before a resume from a checkpoint without positions."""
        self.resumed = False
        """This trainer resumed a checkpoint (groups it did not dispatch itself may arrive)."""
        self.unplaced: set[str] = set()
        """Trained groups, not folded, whose prompt record a dead trainer produced after its checkpoint."""
        self._noted: set[str] = set()
        """Groups whose prompt this trainer produced since it resumed (their records are placed)."""

    # -- the collector's questions and answers ------------------------------------------------

    def settled(self, gid: str) -> bool:
        if gid in self._trained_ids or gid in self.stale:
            return True
        index = group_index(gid, self.run)
        return index is not None and index in self.folded

    def add_trained(self, entry: TrainedEntry) -> None:
        if self.settled(entry.group_id):  # the collector's dedup makes this impossible
            raise AssertionError(f"group {entry.group_id} settled twice (trained)")
        self._trained_ids.add(entry.group_id)
        self.trained.append(entry)
        if self.resumed and entry.group_id not in self.positions \
                and entry.group_id not in self._noted:
            self.unplaced.add(entry.group_id)
        self._maybe_fold()

    def add_stale(self, gid: str, info: dict[str, Any]) -> None:
        if self.settled(gid):
            raise AssertionError(f"group {gid} settled twice (stale)")
        self.stale[gid] = info
        self.positions.pop(gid, None)  # settled, and no audit check needs its prompt record
        self._maybe_fold()

    def note_dispatched(self, gid: str, region: str, partition: int, offset: int) -> None:
        """The prompt record of `gid` landed at (region, partition, offset)."""
        if not self.settled(gid):
            self.positions.setdefault(gid, []).append((region, partition, offset))
        if self.resumed:
            self._noted.add(gid)
        ends = self.ends.setdefault(region, {})
        ends[partition] = max(ends.get(partition, 0), offset + 1)

    @property
    def trained_count(self) -> int:
        return len(self.trained) + self.folded_trained

    @property
    def stale_count(self) -> int:
        return len(self.stale) + self.folded_stale

    # -- folding ------------------------------------------------------------------------------

    def _maybe_fold(self) -> None:
        # Amortised: fold when a layer holds twice its bound, and at every checkpoint.
        if len(self.trained) > 2 * self.detail_groups or len(self.stale) > 2 * self.detail_groups:
            self.fold()

    def fold(self) -> None:
        """Fold all but the newest `detail_groups` rows of each layer into the ranges, and every unplaced
        group however new."""
        keep: list[TrainedEntry] = []
        for n, entry in enumerate(self.trained):
            recent = n >= len(self.trained) - self.detail_groups and entry.group_id not in self.unplaced
            if recent or not self._fold_one(entry.group_id):
                keep.append(entry)
            else:
                self._trained_ids.discard(entry.group_id)
                self.folded_trained += 1
        self.trained = keep
        stale: dict[str, dict[str, Any]] = {}
        for n, (gid, info) in enumerate(self.stale.items()):
            if n >= len(self.stale) - self.detail_groups or not self._fold_one(gid):
                stale[gid] = info
            else:
                self.folded_stale += 1
        self.stale = stale

    def _fold_one(self, gid: str) -> bool:
        index = group_index(gid, self.run)
        if index is None:
            return False  # not a dispatcher id: it keeps its detail row
        if not self.folded.add(index):
            raise AssertionError(f"group {gid} folded twice")
        self.positions.pop(gid, None)
        self.unplaced.discard(gid)
        return True

    def settled_watermarks(self) -> dict[str, dict[int, int]]:
        """Per region and `prompts` partition: the offset the audit may start reading from."""
        if self.unplaced:  # their records may lie anywhere: only folded, they may lie below a watermark
            self.fold()
        if self.blind_below and not self.folded.covers_below(self.blind_below):
            return {}
        self.blind_below = 0
        oldest: dict[tuple[str, int], int] = {}
        for places in self.positions.values():
            for region, partition, offset in places:
                key = (region, partition)
                oldest[key] = min(offset, oldest.get(key, offset))
        for region, ends in self.ends.items():
            marks = self.watermarks.setdefault(region, {})
            for partition, end in ends.items():
                mark = oldest.get((region, partition), end)
                marks[partition] = max(mark, marks.get(partition, 0))
        return self.watermarks

    def restarted_without_checkpoint(self) -> None:
        """This trainer starts over from nothing, but an earlier one of the run (killed before its first
        checkpoint) may have produced prompt records: groups trained here that this trainer did not
        dispatch are unplaced, as after a resume, so no watermark passes over their records while
        they are still detailed (the audit would then find them trained but never dispatched: seen
        in the crash-point sweep, a trainer killed at its second step's snapshot)."""
        self.resumed, self._noted = True, set()

    # -- checkpoint ---------------------------------------------------------------------------

    def state(self) -> dict[str, Any]:
        """The ledger part of the collector's checkpoint state (folds first)."""
        self.fold()
        marks = self.settled_watermarks()
        return {
            "folded": self.folded.rows(), "folded_trained": self.folded_trained, "folded_stale": self.folded_stale,
            "positions": {g: [list(p) for p in ps] for g, ps in self.positions.items()},
            "ends": _by_partition(self.ends), "watermarks": _by_partition(marks), "blind_below": self.blind_below,
        }

    def restore(self, trained: list[list[Any]], stale: dict[str, Any], ledger: dict[str, Any] | None,
                drawn: int) -> None:
        """From a checkpoint; `ledger` is None for format-1 states (every row detailed, no positions),
        `drawn` the dispatcher's prompts drawn by then."""
        self.trained = [TrainedEntry(*row) for row in trained]
        self._trained_ids = {e.group_id for e in self.trained}
        self.stale = dict(stale)
        if ledger is None:
            self.folded, self.folded_trained, self.folded_stale = IndexRanges(), 0, 0
            self.positions, self.ends, self.watermarks, self.blind_below = {}, {}, {}, drawn
            return
        try:
            self.folded = IndexRanges.from_rows(ledger["folded"])
        except ValueError as exc:
            raise CheckpointError(f"checkpoint ledger of run {self.run!r}: folded groups: {exc}") from exc
        self.folded_trained, self.folded_stale = int(ledger["folded_trained"]), int(ledger["folded_stale"])
        if self.folded_trained + self.folded_stale != len(self.folded):
            raise CheckpointError(f"checkpoint ledger of run {self.run!r}: {self.folded_trained} trained + "
                                  f"{self.folded_stale} stale folded groups, but {len(self.folded)} in its ranges")
        self.positions = {g: [(str(r), int(p), int(o)) for r, p, o in ps] for g, ps in ledger["positions"].items()}
        self.ends = _from_partition(ledger["ends"])
        self.watermarks = _from_partition(ledger["watermarks"])
        self.blind_below = int(ledger.get("blind_below", 0))
        # Checkpoints written before unplaced groups were folded at once list them (with `resume_ends`,
        # no longer needed): they fold at the next checkpoint.
        self.unplaced = set(ledger.get("unplaced", []))
        self.resumed, self._noted = True, set()


def _by_partition(marks: dict[str, dict[int, int]]) -> dict[str, list[list[int]]]:
    return {r: [[p, o] for p, o in sorted(ps.items())] for r, ps in marks.items()}


def _from_partition(rows: dict[str, list[list[int]]]) -> dict[str, dict[int, int]]:
    return {str(r): {int(p): int(o) for p, o in ps} for r, ps in rows.items()}
