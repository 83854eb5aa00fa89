"""A tracker's thread and bounded queue: the trainer hands records over and never waits.

`put` never blocks: when the queue is full the record is dropped for this tracker and counted (the
`fleetrl_trainer_tracking_dropped_total` counter, and a log line at the 1st, 10th, 100th, ... drop).
The thread opens the tracker, writes records in order and flushes whenever the queue runs empty; after
a flush it notes the highest step the tracker holds in its `marker` file (`delivered/<tracker>`), so
that a resumed trainer re-sends it exactly the steps it lost (session.py). The
first exception (an SDK missing, a server unreachable, a full disk) is logged once with the tracker's
name and disables it: later records are discarded without a word, and training goes on.
"""

from __future__ import annotations

import contextlib
import functools
import os
import pathlib
import queue
import threading
import time
from collections.abc import Callable
from typing import Any

from fleetrl.log import get_logger
from fleetrl.trainer.tracking.base import Tracker

log = get_logger(__name__)

_STOP = object()
Record = Callable[[Tracker], None]


class TrackerFeed:
    def __init__(self, tracker: Tracker, queue_size: int, on_drop: Callable[[str], None] | None = None,
                 marker: pathlib.Path | None = None) -> None:
        self.tracker, self.marker = tracker, marker
        self._written_step = self._marked_step = -1
        self.name = tracker.name
        self._queue: queue.Queue[Any] = queue.Queue(maxsize=queue_size)
        self._on_drop = on_drop
        self.dropped = 0
        self.written = 0
        self.failed: str | None = None
        """The error that disabled the tracker, or None."""
        self._thread = threading.Thread(target=self._run, name=f"fleetrl-tracker-{self.name}", daemon=True)
        self._thread.start()

    def put(self, step: int, record: Record) -> None:
        """Hand a record of `step` to the thread, or drop it (counted) when the queue is full. Never blocks."""
        if self.failed is not None:
            return
        try:
            self._queue.put_nowait((step, record))
        except queue.Full:
            self.dropped += 1
            if self._on_drop is not None:
                self._on_drop(self.name)
            if _is_power_of_ten(self.dropped):
                log.warning("tracking.dropped", tracker=self.name, dropped=self.dropped,
                            queue_size=self._queue.maxsize)

    def close(self, timeout_s: float) -> bool:
        """Let the thread write what it holds and end the tracker's run, within `timeout_s`; True when it
        did (a tracker still stuck is left to its daemon thread)."""
        deadline = time.monotonic() + timeout_s
        with contextlib.suppress(queue.Full):  # a full queue of a stuck tracker: the join below times out
            self._queue.put(_STOP, timeout=timeout_s)
        self._thread.join(max(deadline - time.monotonic(), 0.0))
        if self._thread.is_alive():
            log.warning("tracking.close_timeout", tracker=self.name, timeout_s=timeout_s,
                        waiting=self._queue.qsize())
            return False
        return True

    def _run(self) -> None:
        if self._guard("open", self.tracker.open):
            stopped = False
            while not stopped:
                item = self._queue.get()
                if item is _STOP:
                    stopped = True
                elif self.failed is None and self._guard("write", functools.partial(item[1], self.tracker)):
                    self.written += 1
                    self._written_step = max(self._written_step, item[0])
                idle = stopped or self._queue.empty()
                if self.failed is None and idle and self._guard("flush", self.tracker.flush):
                    self._mark()
            if self.failed is None:
                self._guard("close", self.tracker.close)
            return
        while self._queue.get() is not _STOP:  # disabled at open: discard until closed
            pass

    def _mark(self) -> None:
        """Note the highest step flushed (a write and a rename: a kill leaves the old or the new value)."""
        if self.marker is None or self._written_step <= self._marked_step:
            return
        try:
            self.marker.parent.mkdir(parents=True, exist_ok=True)
            tmp = self.marker.with_suffix(".tmp")
            tmp.write_text(str(self._written_step))
            os.replace(tmp, self.marker)
            self._marked_step = self._written_step
        except OSError as exc:  # a resume would re-send more than needed; nothing is lost
            log.warning("tracking.marker_failed", tracker=self.name, path=str(self.marker), error=str(exc))

    def _guard(self, what: str, action: Callable[[], None]) -> bool:
        try:
            action()
            return True
        except BaseException as exc:  # any SDK error disables the tracker, never the trainer
            self.failed = f"{type(exc).__name__}: {exc}"
            log.error("tracking.tracker_failed", tracker=self.name, during=what, error=self.failed[:500],
                      note="this tracker is disabled; training goes on")
            return False


def _is_power_of_ten(n: int) -> bool:
    while n % 10 == 0 and n > 1:
        n //= 10
    return n == 1
