"""Rollout worker behaviour (`rollout`), the same in every region: deadlines, handover, consumer-group
membership, weight polling, scheduling."""

from __future__ import annotations

from pydantic import Field

from fleetrl.config.base import Model


class RolloutConfig(Model):
    """Rollout worker behaviour, the same in every region."""

    group_deadline_s: float = Field(600.0, gt=0)
    """A group still running past this is handed over as a partial (long-tail cut)."""
    handover_timeout_s: float = Field(20.0, gt=0)
    """On SIGTERM / preemption, the time allowed to publish partials and commit."""
    min_version_wait_s: float = Field(120.0, gt=0)
    """How long a worker waits for a prompt's `min_version` before handing it back."""
    max_groups_in_flight: int = Field(4, ge=1)
    """Groups a worker decodes concurrently (their samples share the engine's batch)."""
    group_session_timeout_s: float = Field(6.0, ge=1.0, le=300.0)
    """Session timeout of a worker's membership of its region's consumer group (heartbeats every quarter
    of it, at most every second): a worker silent this long is dropped and its partitions move. Kafka
    refuses less than its brokers' `group.min.session.timeout.ms` (6 s unless set). tansu, the embedded
    broker, holds every join for half of it, so in a region of preemptible nodes, whose group changes
    members every few seconds, a shorter one (2 s) makes each rebalance shorter (docs/rollout.md,
    "Rebalances")."""
    weight_fallback_poll_s: float = Field(120.0, gt=0)
    """Fallback only: how often a worker reads its region store's `latest` by itself. Workers pull a new
    version when the region's replica announcement (`fleetrl/<run>/replicas/<region>`, or the policy
    announcement where the region reads the home store) changes; this poll covers a silent control plane."""
    metrics_port: int | None = Field(None, ge=0, le=65535)
    """Port of the region agent's `/metrics` and `/healthz` (0 picks a free port; None disables)."""
    seed: int = 0
    """Base seed of sampling; a sample's randomness depends only on it, the group and position."""
    idle_poll_s: float = Field(0.5, gt=0)
    """How long an idle worker waits on Kafka per poll (a busy one only takes what is already there)."""
    stats_interval_s: float = Field(10.0, gt=0)
    """How often a worker logs `worker.stats` (groups and tokens done and in flight, tokens/s)."""
    length_aware: bool = True
    """Schedule by predicted completion length (the mean of a prompt's earlier completions): the torch
    engine admits the samples with the longest predicted completion first into free slots, and the
    trainer scales each region's latency by the group's predicted length when it places the group.
    False: arrival order, and placement as for groups of average length."""
