"""How the region agent supervises its node's rollout workers (`agent`): progress reports, hang
detection, restarts with backoff and the crash-loop state."""

from __future__ import annotations

from pydantic import Field

from fleetrl.config.base import Model


class AgentConfig(Model):
    """How the region agent supervises its node's rollout workers (one child process per engine)."""

    progress_interval_s: float = Field(2.0, gt=0)
    """How often a worker reports its progress (engine steps, groups, version) to its agent."""
    hang_timeout_s: float = Field(120.0, gt=0)
    """A worker that reports nothing this long, or has work and takes no engine step this long, is hung:
    it is killed and restarted (its uncommitted groups go back to the region's consumer group)."""
    start_timeout_s: float = Field(600.0, gt=0)
    """Bound on a worker's start (engine build, first weights) before its first progress report."""
    restart_backoff_s: float = Field(1.0, gt=0)
    """First delay before restarting a crashed or hung worker; doubles on each quick failure."""
    restart_backoff_max_s: float = Field(60.0, gt=0)
    """Cap of the restart backoff."""
    crashloop_after: int = Field(3, ge=1)
    """Consecutive quick failures after which the engine is reported `crashloop` (it keeps being
    restarted at the capped backoff, and turns `up` again once a worker stays up)."""
    healthy_after_s: float = Field(60.0, gt=0)
    """A worker that ran this long before failing was healthy: its failure resets the backoff."""
