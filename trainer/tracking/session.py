"""The trainer's side of tracking: which run, and when a step's figures are released.

A step's figures are held until a checkpoint covering the step is durable, then released to
`metrics.jsonl` and the trackers in step order (`release`, called right after the checkpoint is
committed). A trainer killed before that checkpoint redoes the step from the previous one, and only
the redone step's figures are ever written: no step appears twice in any tracker, nor in
`metrics.jsonl`. The cost is that figures lag by up to `trainer.checkpoint_every` steps (one, by
default), and that records still in a tracker's queue when the process is SIGKILLed are lost to that
tracker (a gap, never a duplicate; metrics.jsonl is written at release, before the queues).

The identity of the tracker run (a key: W&B's run id, MLflow's tag, with the run name) is part of the
checkpoint (`state`/`restore`), so a resumed trainer continues the same run; TensorBoard additionally
reopens with `purge_step` past the checkpoint's step.
"""

from __future__ import annotations

import pathlib
import uuid
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from fleetrl.config import FleetConfig
from fleetrl.log import get_logger
from fleetrl.trainer.tracking.base import TrackerContext
from fleetrl.trainer.tracking.figures import SAMPLE_COLUMNS, make_decoder, sample_rows, step_figures
from fleetrl.trainer.tracking.writer import ExperimentLog, NullExperimentLog

log = get_logger(__name__)
SAMPLES_TABLE = "samples"


def tracking_dir(config: FleetConfig) -> pathlib.Path:
    """`tracking.output_dir`, or `tracking/` inside the checkpoint folder."""
    t = config.tracking
    return pathlib.Path(t.output_dir) if t.output_dir else pathlib.Path(config.trainer.checkpoint_dir) / "tracking"


def open_experiment_log(config: FleetConfig, *, key: str, run_name: str, resume_step: int | None = None,
                        on_drop: Callable[[str], None] | None = None) -> ExperimentLog:
    """metrics.jsonl in the run's tracking folder plus one feed per `tracking.report_to` entry."""
    from fleetrl.trainer.tracking.trackers import build_trackers

    t = config.tracking
    context = TrackerContext(tracking_dir(config), t, run_name, key, resume_step, run_params(config))
    return ExperimentLog(context.directory, build_trackers(context), queue_size=t.queue_size, on_drop=on_drop)


def run_params(config: FleetConfig) -> dict[str, Any]:
    """Flat hyperparameters logged with the tracker run."""
    params: dict[str, Any] = {"run": config.run, "model": config.model.path or "tiny"}
    for name, value in config.algorithm.model_dump(mode="json").items():
        params[f"algorithm.{name}"] = value
    return params


class TrainerTracking:
    """Step figures held until a checkpoint covers them; the tracker run's identity in the checkpoint."""

    def __init__(self, config: FleetConfig, on_drop: Callable[[str], None] | None = None) -> None:
        self.config, self._on_drop = config, on_drop
        self.key = uuid.uuid4().hex[:16]
        self.run_name = config.tracking.run_name or config.run
        self.resume_step: int | None = None
        self.log: ExperimentLog = NullExperimentLog()
        """The writer (also for other figures of the run, e.g. evals); `NullExperimentLog` until `start`."""
        self._pending: dict[int, list[Callable[[ExperimentLog], None]]] = {}
        self._decode: Callable[[Sequence[int]], str] | None = None

    def state(self) -> dict[str, Any]:
        return {"key": self.key, "run_name": self.run_name}

    def restore(self, state: Mapping[str, Any] | None, step: int) -> None:
        """Continue the tracker run of a checkpoint (one written before tracking existed starts a new one)."""
        self.resume_step = step
        if state:
            self.key, self.run_name = str(state["key"]), str(state["run_name"])

    def start(self) -> None:
        """Open metrics.jsonl and the trackers (each in its own thread: this returns at once)."""
        self.log = open_experiment_log(self.config, key=self.key, run_name=self.run_name,
                                       resume_step=self.resume_step, on_drop=self._on_drop)
        log.info("tracking.started", directory=str(self.log.directory), trackers=self.config.tracking.report_to,
                 run_name=self.run_name, key=self.key, resumed_at=self.resume_step)

    def record_step(self, step: int, version: int, groups: Sequence[Any], **figures_of: Any) -> None:
        """Hold step `step`'s figures (and, every `samples_every` steps, its samples table) until `release`."""
        figures = step_figures(version=version, groups=groups, **figures_of)
        records: list[Callable[[ExperimentLog], None]] = [lambda w: w.scalars(step, figures)]
        every = self.config.tracking.samples_every
        if every and step % every == 0:
            if self._decode is None:
                self._decode = make_decoder(self.config.model.tokenizer_source)
            rows = sample_rows(step, version, groups, self.config.tracking.samples_rows, self._decode)
            records.append(lambda w: w.table(step, SAMPLES_TABLE, SAMPLE_COLUMNS, rows))
        self._pending[step] = records

    def release(self, step: int) -> None:
        """A checkpoint covering `step` is durable: write the figures of every step up to it, in order."""
        for s in sorted(k for k in self._pending if k <= step):
            for record in self._pending.pop(s):
                record(self.log)

    def close(self, timeout_s: float | None = None) -> None:
        if self._pending:  # steps no checkpoint covers (a failed run): they will be redone, not written
            log.info("tracking.unreleased", steps=sorted(self._pending))
        self.log.close(self.config.tracking.close_timeout_s if timeout_s is None else timeout_s)
