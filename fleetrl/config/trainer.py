"""The central trainer (`trainer`): device, checkpoints, metrics, timeouts, background publishing,
placement of groups on regions, and the emulated learner benchmarks use."""

from __future__ import annotations

from pydantic import Field

from fleetrl.config.base import Model
from fleetrl.config.pricing import PlacementConfig


class LearnerEmulation(Model):
    """Emulated training hardware for benchmarks on CPU (`bench/pipeline.py --profile production`):
    the real learner step, made as long as a larger model's on real GPUs would be, the way
    `EngineEmulation` slows the real engine's decoding. Off unless set; never needed in production."""

    step_delay_s: float = Field(0.0, ge=0, le=600)
    """Added to every optimizer step (fixed costs: the optimizer update, gathers)."""
    token_delay_s: float = Field(0.0, ge=0, le=1)
    """Added per trained token (forward and backward over each sample's tokens)."""


class TrainerConfig(Model):
    """The central trainer."""

    device: str = "cpu"
    """Torch device of the learner (`cpu`, `cuda`, `cuda:1`)."""
    checkpoint_dir: str = "./.fleetrl/checkpoints"
    """Where checkpoints go (relative to the config file)."""
    checkpoint_every: int = Field(1, ge=1)
    """Steps between checkpoints; offsets are committed only after the checkpoint is durable."""
    keep_checkpoints: int = Field(2, ge=1)
    """Checkpoints kept on disk; older ones are deleted after a new one is durable."""
    ledger_detail_groups: int = Field(1024, ge=1)
    """Settled groups (trained, and stale) the checkpoint's ledger keeps row by row; older ones are
    folded into ranges of group indices, so checkpoints stay small over any run length."""
    metrics_port: int | None = Field(None, ge=0, le=65535)
    """Prometheus port of the trainer (0 picks a free port; None disables)."""
    silent_region_timeout_s: float = Field(300.0, gt=0)
    """A group dispatched to a region that stays silent this long is redispatched (new attempt). A region
    whose nodes are all draining, offline or without heartbeats for two `mqtt.heartbeat_interval_s` is
    handled sooner: its partials and groups move to another region (docs/trainer.md, handover)."""
    threads: int = Field(1, ge=1)
    """torch intra-op threads of the learner on CPU."""
    drain_timeout_s: float = Field(30.0, gt=0)
    """On SIGTERM, the time allowed to finish the step, checkpoint and commit."""
    start_timeout_s: float = Field(300.0, gt=0)
    """How long a starting trainer waits for its first region's Kafka when none answers (a partition, a
    broker restarting), retrying with backoff and logging `trainer.waiting_for_regions`, before it exits
    with a fatal error. One region is enough to start; the others join when they answer."""
    publish_in_background: bool = True
    """Encode, upload and announce each version while the next step trains (one publish in flight,
    versions in order); False publishes inline, between the step and the next."""
    throughput_window_s: float = Field(60.0, gt=0)
    """Window over which each region's throughput (arrivals, heartbeats) is measured for credits."""
    emulate: LearnerEmulation | None = None
    """Emulated training time for benchmarks on CPU (see `LearnerEmulation`)."""
    placement: PlacementConfig = Field(default_factory=PlacementConfig)
    """How admitted groups are placed on regions (price-aware placement is off by default; docs/cost.md)."""
