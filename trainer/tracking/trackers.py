"""`tracking.report_to` names -> tracker classes (each imports its SDK only when opened)."""

from __future__ import annotations

from fleetrl.trainer.tracking.base import Tracker, TrackerContext
from fleetrl.trainer.tracking.to_mlflow import MlflowTracker
from fleetrl.trainer.tracking.to_tensorboard import TensorBoardTracker
from fleetrl.trainer.tracking.to_trackio import TrackioTracker
from fleetrl.trainer.tracking.to_wandb import WandbTracker

TRACKER_CLASSES: dict[str, type[Tracker]] = {
    cls.name: cls for cls in (TensorBoardTracker, MlflowTracker, WandbTracker, TrackioTracker)
}
EXTRAS = {"tensorboard": "tensorboard", "mlflow": "mlflow", "wandb": "wandb", "trackio": "trackio"}
"""The pip extra of FleetRL that installs each tracker's library."""


def build_trackers(context: TrackerContext) -> list[Tracker]:
    return [TRACKER_CLASSES[name](context) for name in context.settings.report_to]
