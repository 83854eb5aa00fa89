"""Which offsets a consumer may commit: the bookkeeping behind commit-after-effect.

Per partition the tracker knows each offset it handed out (`delivered`), each it sent to the
dead-letter topic (`dead`, handled as soon as the dead letter was acknowledged) and each the caller
said is durable (`done`). The commit point of a partition is one past the highest offset the caller
passed to `commit`, moved further over any run of offsets that are already handled, so that dead
letters (which the caller never sees) are committed too and never re-read. Pure bookkeeping: no I/O.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Literal

TP = tuple[str, int]
State = Literal["delivered", "dead", "done"]


class OffsetTracker:
    def __init__(self) -> None:
        self._states: dict[TP, dict[int, State]] = {}
        self._committed: dict[TP, int] = {}

    def delivered(self, tp: TP, offset: int) -> None:
        self._states.setdefault(tp, {})[offset] = "delivered"

    def dead(self, tp: TP, offset: int) -> None:
        self._states.setdefault(tp, {})[offset] = "dead"

    def targets(self, given: Iterable[tuple[TP, int]] = ()) -> dict[TP, int]:
        """Commit point per partition if the offsets `given` were durable; only points that move."""
        highest: dict[TP, int] = {}
        done: dict[TP, set[int]] = {}
        for tp, offset in given:
            highest[tp] = max(highest.get(tp, -1), offset)
            done.setdefault(tp, set()).add(offset)
        out: dict[TP, int] = {}
        for tp in set(self._states) | set(highest):
            point = self._point(tp, highest.get(tp), done.get(tp, set()))
            if point is not None and point > self._committed.get(tp, -1):
                out[tp] = point
        return out

    def committed(self, points: dict[TP, int], given: Iterable[tuple[TP, int]] = ()) -> None:
        """Record that `points` were committed; forget everything below them."""
        for tp, offset in given:
            if offset in self._states.get(tp, {}):
                self._states[tp][offset] = "done"
        for tp, point in points.items():
            self._committed[tp] = max(point, self._committed.get(tp, -1))
            states = self._states.get(tp, {})
            for offset in [o for o in states if o < point]:
                del states[offset]

    def positions(self) -> dict[TP, int]:
        """Last committed point per partition (what a restarted consumer resumes from)."""
        return dict(self._committed)

    def forget(self, tps: Iterable[TP]) -> None:
        """Partitions revoked or re-positioned: their undelivered bookkeeping no longer applies."""
        for tp in tps:
            self._states.pop(tp, None)
            self._committed.pop(tp, None)

    def _point(self, tp: TP, highest: int | None, done: set[int]) -> int | None:
        states = self._states.get(tp, {})
        point = self._committed.get(tp)
        if highest is not None:
            point = max(point if point is not None else -1, highest + 1)
        if point is None:
            if not states:
                return None
            point = min(states)  # where this member started reading: the group's committed point
        start = point
        # Dead letters and offsets already done right after the point are handled: move past them.
        while point in states and (states[point] != "delivered" or point in done):
            point += 1
        return point if highest is not None or point > start or tp in self._committed else None
