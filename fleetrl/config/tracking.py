"""Experiment trackers (`tracking`): where the trainer's per-step figures go besides its own
`metrics.jsonl` (DESIGN.md §12). `report_to` takes TRL's names; each tracker is its own library,
installed with its extra (`pip install 'fleetrl[tensorboard]'`, `[mlflow]`, `[wandb]`, `[trackio]`)."""

from __future__ import annotations

import urllib.parse
from typing import Literal

from pydantic import Field, field_validator

from fleetrl.config.base import Model

TrackerName = Literal["tensorboard", "mlflow", "wandb", "trackio"]
TRACKERS: tuple[str, ...] = ("tensorboard", "mlflow", "wandb", "trackio")
_MLFLOW_SCHEMES = ("http", "https", "file", "sqlite", "postgresql", "mysql", "mssql", "databricks")


class TrackingConfig(Model):
    """Experiment trackers fed by the trainer (docs/tracking.md). Empty `report_to`: `metrics.jsonl` only."""

    report_to: list[TrackerName] = Field(default_factory=list)
    """Trackers, by TRL's `report_to` names: `tensorboard`, `mlflow`, `wandb`, `trackio`. Each is fed by
    its own thread through a bounded queue and never blocks the trainer; one that fails is logged once and
    disabled. The trainer always appends every step to `<output_dir>/metrics.jsonl` as well."""
    project: str = Field("fleetrl", min_length=1, max_length=128)
    """Project (W&B, trackio) or experiment (MLflow) the run is logged under."""
    run_name: str | None = Field(None, min_length=1, max_length=128)
    """Name of the tracker run (None: the run id, `run`). A resumed trainer continues the same tracker run:
    its identity is kept in the checkpoint."""
    output_dir: str | None = None
    """Folder of `metrics.jsonl`, TensorBoard's event files and W&B's offline files (relative to the config
    file; None: `tracking/` inside `trainer.checkpoint_dir`; `fleetrl demo` puts it under its `--out`)."""
    mlflow_tracking_uri: str | None = None
    """MLflow tracking server or store (`http://host:5000`, `sqlite:///mlflow.db`, ...). None: the
    `MLFLOW_TRACKING_URI` environment variable, else MLflow's own default."""
    mlflow_request_timeout_s: float = Field(10.0, gt=0, le=600)
    """Bound of one MLflow HTTP request (retries are capped at 2): an unreachable server disables the MLflow
    tracker after at most a few of these, in its own thread."""
    wandb_mode: Literal["offline", "online", "disabled"] = "offline"
    """W&B mode: `offline` (default) writes the run under `output_dir/wandb` for `wandb sync`, with no network;
    `online` needs `WANDB_API_KEY`."""
    queue_size: int = Field(1024, ge=1, le=1_000_000)
    """Records (one per step or table) each tracker's queue holds; when full, new records are dropped for that
    tracker and counted (`fleetrl_trainer_tracking_dropped_total`), never waited for."""
    samples_every: int = Field(10, ge=0)
    """Steps between two tables of sample completions with their rewards (0: none); logged where the
    tracker has tables (W&B, MLflow, trackio; TensorBoard as a text table)."""
    samples_rows: int = Field(4, ge=1, le=64)
    """Samples in each table (the first sample of the step's first groups)."""
    close_timeout_s: float = Field(30.0, gt=0, le=600)
    """At the trainer's exit, how long the trackers may take to write what they hold before it goes on
    without them."""

    @field_validator("report_to")
    @classmethod
    def _unique(cls, value: list[str]) -> list[str]:
        twice = sorted({name for name in value if value.count(name) > 1})
        if twice:
            raise ValueError(f"{', '.join(twice)} listed more than once")
        return value

    @field_validator("mlflow_tracking_uri")
    @classmethod
    def _mlflow_uri(cls, value: str | None) -> str | None:
        if value is None:
            return None
        scheme = urllib.parse.urlsplit(value).scheme.split("+")[0]
        if scheme not in _MLFLOW_SCHEMES:
            raise ValueError(f"{value!r}: not an MLflow tracking URI (scheme one of {', '.join(_MLFLOW_SCHEMES)})")
        return value
