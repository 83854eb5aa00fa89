"""Experiment figures for the trackers researchers already use (DESIGN.md §12, docs/tracking.md).

`ExperimentLog` is the one writer: `scalars(step, figures)`, `table(step, name, columns, rows)`,
`close(timeout_s)`; it appends every record to a local `metrics.jsonl` and hands it to one feed per
tracker (`tracking.report_to`: TensorBoard, MLflow, W&B, trackio, TRL's names), each a thread behind a
bounded queue, so the trainer never waits on a tracker. `NullExperimentLog` is the disabled form.
`TrainerTracking` is the trainer's use of it: a step's figures are released once a checkpoint covers
the step, and the tracker run's identity travels in the checkpoint.
"""

from fleetrl.trainer.tracking.base import Tracker, TrackerContext
from fleetrl.trainer.tracking.session import TrainerTracking, open_experiment_log, tracking_dir
from fleetrl.trainer.tracking.writer import METRICS_FILE, ExperimentLog, NullExperimentLog

__all__ = [
    "METRICS_FILE",
    "ExperimentLog",
    "NullExperimentLog",
    "Tracker",
    "TrackerContext",
    "TrainerTracking",
    "open_experiment_log",
    "tracking_dir",
]
