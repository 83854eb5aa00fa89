"""The demo's `Restart=on-failure`: a daemon that fails on its own is restarted, as its unit would be.

The packaged units (regions/systemd/*.service) restart the trainer, the agents and the replicators when
they exit non-zero. A daemon of the demo that does so by itself (not killed by the chaos, which restarts
its own victims) is restarted the same way instead of ending the run: after a backoff that doubles from
`BACKOFF_S` up to `BACKOFF_MAX_S`, and only `START_LIMIT` times in a row; a daemon that ran
`HEALTHY_AFTER_S` before it failed was healthy, and its count starts again. Past the limit the failure is
fatal, as systemd's start limit would leave the unit failed. An exit 0 is never restarted.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from fleetrl.demo.procs import Child

BACKOFF_S = 1.0
BACKOFF_MAX_S = 30.0
START_LIMIT = 5
"""Failures in a row (none after a healthy run) after which a daemon's failure ends the demo."""
HEALTHY_AFTER_S = 60.0


@dataclass
class Restart:
    child: Child
    due: float
    failure: int
    """The how-manieth failure in a row this is (1-based)."""
    delay_s: float


@dataclass
class OnFailure:
    """Which daemons wait for a restart after a failure of their own, and when each is due."""

    failures: dict[str, int] = field(default_factory=dict)
    started: dict[str, float] = field(default_factory=dict)
    """Child name -> when it was last (re)started by this policy, for HEALTHY_AFTER_S."""
    pending: dict[str, Restart] = field(default_factory=dict)

    def failed(self, child: Child, now: float | None = None) -> Restart | None:
        """`child` exited non-zero by itself: schedule its restart (returned), or None once it has failed
        START_LIMIT times in a row (the caller then treats the failure as fatal)."""
        now = time.monotonic() if now is None else now
        if child.name in self.pending:
            return self.pending[child.name]
        healthy = now - self.started.get(child.name, now) >= HEALTHY_AFTER_S
        count = 1 if healthy else self.failures.get(child.name, 0) + 1
        self.failures[child.name] = count
        if count > START_LIMIT:
            return None
        delay_s = min(BACKOFF_S * 2 ** (count - 1), BACKOFF_MAX_S)
        self.pending[child.name] = restart = Restart(child, now + delay_s, count, delay_s)
        return restart

    def waiting(self, child: Child) -> bool:
        """Whether `child` is down on purpose, waiting for its restart."""
        return child.name in self.pending

    def due(self, now: float | None = None) -> list[Child]:
        """The children whose restart is due now (each handed out once; the caller restarts them)."""
        now = time.monotonic() if now is None else now
        ready = [r for r in self.pending.values() if r.due <= now]
        for r in ready:
            del self.pending[r.child.name]
            self.started[r.child.name] = now
        return [r.child for r in ready]
