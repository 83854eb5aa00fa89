"""`ExperimentLog`: the one writer of experiment figures (DESIGN.md §12).

Every record is appended at once to the local `metrics.jsonl` (one JSON object per line: `{"step", ...
figures}` for scalars, `{"step", "table", "columns", "rows"}` for a table; non-finite numbers as null),
then handed to each tracker's feed (feed.py), which writes it from its own thread. Nothing here waits
on a tracker. `NullExperimentLog` is the disabled form: it writes nothing.
"""

from __future__ import annotations

import functools
import json
import math
import pathlib
from collections.abc import Callable, Mapping, Sequence
from typing import IO, Any

from fleetrl.log import get_logger
from fleetrl.trainer.tracking.base import Tracker
from fleetrl.trainer.tracking.feed import TrackerFeed

log = get_logger(__name__)

METRICS_FILE = "metrics.jsonl"
DEFAULT_CLOSE_TIMEOUT_S = 30.0


class ExperimentLog:
    """Figures by step to `metrics.jsonl` and to every tracker; `scalars` and `table` never block."""

    def __init__(self, directory: pathlib.Path | None, trackers: Sequence[Tracker] = (), *, queue_size: int = 1024,
                 on_drop: Callable[[str], None] | None = None) -> None:
        self.directory = directory
        self._jsonl: IO[str] | None = None
        if directory is not None:
            directory.mkdir(parents=True, exist_ok=True)
            self._jsonl = open(directory / METRICS_FILE, "a", encoding="utf-8")  # noqa: SIM115 (closed in close)
        self.feeds = [TrackerFeed(t, queue_size, on_drop, delivered_marker(directory, t.name) if directory else None)
                      for t in trackers]
        self._closed = False

    def scalars(self, step: int, figures: Mapping[str, float]) -> None:
        """The figures of `step` (names like `train/loss`)."""
        clean = {name: float(value) for name, value in figures.items()}
        self._append({"step": int(step), **{k: v if math.isfinite(v) else None for k, v in clean.items()}})
        for feed in self.feeds:
            feed.put(int(step), functools.partial(_scalars, int(step), clean))

    def table(self, step: int, name: str, columns: Sequence[str], rows: Sequence[Sequence[Any]]) -> None:
        """A table (`columns`, one list per row) at `step`, where the tracker has tables."""
        cols, body = [str(c) for c in columns], [list(r) for r in rows]
        for i, row in enumerate(body):
            if len(row) != len(cols):
                raise ValueError(f"ExperimentLog.table({name!r}): row {i} has {len(row)} values for "
                                 f"{len(cols)} columns")
        self._append({"step": int(step), "table": name, "columns": cols, "rows": body})
        for feed in self.feeds:
            feed.put(int(step), functools.partial(_table, int(step), name, cols, body))

    def close(self, timeout_s: float = DEFAULT_CLOSE_TIMEOUT_S) -> None:
        """Let every tracker write what it holds and end its run, all within `timeout_s` together
        (idempotent)."""
        if self._closed:
            return
        self._closed = True
        import time

        deadline = time.monotonic() + timeout_s
        for feed in self.feeds:
            feed.close(max(deadline - time.monotonic(), 0.0))
        if self._jsonl is not None:
            self._jsonl.close()

    def resend(self, tracker: str, rows: Sequence[Mapping[str, Any]]) -> None:
        """Hand rows of metrics.jsonl (scalars and tables) to one tracker again, not to the file: what a
        killed trainer had released and that tracker had not flushed (session.py)."""
        for feed in self.feeds:
            if feed.name != tracker:
                continue
            for row in rows:
                step = int(row["step"])
                if "table" in row:
                    feed.put(step, functools.partial(_table, step, str(row["table"]), row["columns"], row["rows"]))
                else:
                    figures = {k: float("nan") if v is None else float(v) for k, v in row.items() if k != "step"}
                    feed.put(step, functools.partial(_scalars, step, figures))

    def dropped(self) -> dict[str, int]:
        """Records dropped so far per tracker (a full queue)."""
        return {feed.name: feed.dropped for feed in self.feeds}

    def failed(self) -> dict[str, str]:
        """Trackers disabled by an error, with it."""
        return {feed.name: feed.failed for feed in self.feeds if feed.failed is not None}

    def _append(self, row: dict[str, Any]) -> None:
        if self._jsonl is None:
            return
        try:
            self._jsonl.write(json.dumps(row, default=str) + "\n")
            self._jsonl.flush()
        except OSError as exc:  # the local record is lost, the run is not
            log.error("tracking.jsonl_failed", path=str(self.directory), error=str(exc),
                      note="metrics.jsonl is disabled; training goes on")
            self._jsonl = None


def delivered_marker(directory: pathlib.Path, tracker: str) -> pathlib.Path:
    """The file where a tracker's feed notes the highest step it flushed."""
    return directory / "delivered" / tracker


def delivered_step(directory: pathlib.Path, tracker: str) -> int:
    """The highest step `tracker` flushed in an earlier process (-1: none noted)."""
    try:
        return int(delivered_marker(directory, tracker).read_text().strip())
    except (OSError, ValueError):
        return -1


def _scalars(step: int, figures: Mapping[str, float], tracker: Tracker) -> None:
    tracker.scalars(step, figures)


def _table(step: int, name: str, columns: Sequence[str], rows: Sequence[Sequence[Any]], tracker: Tracker) -> None:
    tracker.table(step, name, columns, rows)


class NullExperimentLog(ExperimentLog):
    """Tracking off: every call is accepted and nothing is written."""

    def __init__(self) -> None:
        super().__init__(None)

    def scalars(self, step: int, figures: Mapping[str, float]) -> None:
        return None

    def table(self, step: int, name: str, columns: Sequence[str], rows: Sequence[Sequence[Any]]) -> None:
        return None
