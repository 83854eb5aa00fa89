"""When a demo run has done what it was asked, and how it then ends.

The demo ends its run itself, rather than after `--steps`, at the end of `--duration`, once every
`--fuzz-records` record is dead-lettered (`FuzzFeed.all_read`), or once every fault asked for has
happened and been recovered from and every evaluation scheduled so far has finished (`--until-faults`,
`Chaos.all_happened`, `Chaos.recovered`, the view's `eval.scheduled` and `eval.done`).
`RunEnd.tick`, called from the runner's watch loop, then stops the faults and the fuzzer's orders
and, after a grace for the consumers to read what was sent, SIGTERMs the trainer, which drains,
checkpoints and exits 0; the runner's watch loop ends when the trainer has exited.
"""

from __future__ import annotations

import time

from fleetrl.demo.chaos import Chaos, FaultPlan
from fleetrl.demo.fuzz_feed import FuzzFeed
from fleetrl.demo.procs import Child

_DURATION_GRACE_S = 10.0  # after --duration: hostile records already sent are read before the trainer stops


class RunEnd:
    """The end conditions of one run (`started`: when it started, monotonic) and the trainer's stop."""

    def __init__(self, plan: FaultPlan, duration_s: float | None, started: float, chaos: Chaos, trainer: Child,
                 feed: FuzzFeed | None) -> None:
        self.plan, self.duration_s, self.started = plan, duration_s, started
        self.chaos, self.trainer, self.feed = chaos, trainer, feed
        self._terminate_at: float | None = None

    def tick(self) -> None:
        """At the end of --duration, once every --fuzz-records record is dead-lettered, or once every fault
        is recovered from (--until-faults): no more faults nor hostile records, then (after a grace for
        the consumers to read what was sent, where some may be unread) SIGTERM to the trainer, which
        drains, checkpoints and exits 0."""
        now = time.monotonic()
        if self._terminate_at is None:
            grace = self._run_over(now)
            if grace is None:
                return
            if not self.chaos.stopped:
                self.chaos.stop()  # heals and restarts what is down, the trainer included
            if self.feed is not None:
                self.feed.stopped = True
            self._terminate_at = now + grace
        elif now >= self._terminate_at and self.trainer.returncode() is None:
            self.trainer.terminate()
            self._terminate_at = float("inf")

    def _run_over(self, now: float) -> float | None:
        """Whether the run has done what it was asked to (None: not yet); then the consumers' grace."""
        if self.duration_s is not None and now - self.started >= self.duration_s:
            return _DURATION_GRACE_S
        if self.plan.fuzz_records and self.feed is not None and self.feed.all_read(now):
            return 0.0  # every hostile record is read: nothing is left for a grace
        if self.plan.until_faults:
            if not self.chaos.stopped and self.chaos.all_happened():
                self.chaos.stop()  # no new faults: a step after the last recovery ends the run
            progress = self.chaos.demo.progress
            if self.chaos.recovered() and progress.evals_scheduled <= progress.evals.keys():
                # (and every evaluation scheduled so far finished: the run proves they survive the faults)
                return _DURATION_GRACE_S if self.plan.fuzzing else 0.0
        return None
