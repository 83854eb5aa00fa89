"""What every tracker is: a small writer a `TrackerFeed` drives from its own thread (feed.py).

A tracker wraps one library's SDK (TensorBoard, MLflow, W&B, trackio), imported in `open`, inside the
feed's thread, so that neither the import nor a slow server ever holds up the trainer; any exception a
tracker raises disables it (logged once, by the feed). `TrackerContext` is what each needs to find its
run again after a restart: a stable `key` kept in the trainer's checkpoint and, when resumed, the
checkpoint's step.
"""

from __future__ import annotations

import pathlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

from fleetrl.config import TrackingConfig


@dataclass(slots=True, frozen=True)
class TrackerContext:
    directory: pathlib.Path
    """The run's tracking folder (`tracking.output_dir`): metrics.jsonl, event files, offline runs."""
    settings: TrackingConfig
    run_name: str
    key: str
    """Stable identity of the tracker run across restarts (W&B run id, MLflow tag, TensorBoard folder)."""
    resume_step: int | None = None
    """The checkpoint's step when the trainer resumed; figures of later steps were never released."""
    params: Mapping[str, Any] = field(default_factory=dict)
    """Flat hyperparameters logged once with the run (`algorithm.*`, the run id)."""
    delivered: Mapping[str, int] = field(default_factory=dict)
    """Per tracker, the highest step an earlier process of the run saw it flush (missing: none noted)."""


class Tracker:
    """One tracker. Every method runs in the tracker's feed thread; any exception disables it."""

    name: ClassVar[str] = ""

    def __init__(self, context: TrackerContext) -> None:
        self.context = context

    def open(self) -> None:
        """Import the SDK and start (or resume) the run."""

    def scalars(self, step: int, figures: Mapping[str, float]) -> None:
        raise NotImplementedError

    def table(self, step: int, name: str, columns: Sequence[str], rows: Sequence[Sequence[Any]]) -> None:
        raise NotImplementedError

    def flush(self) -> None:
        """Make what was written so far durable (called when the feed's queue runs empty)."""

    def close(self) -> None:
        """End the run; called once, after the last record."""


def markdown_table(columns: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """A table as Markdown, for trackers that show text but have no table type (TensorBoard)."""
    def cell(value: Any) -> str:
        return str(value).replace("|", "\\|").replace("\n", " ")

    lines = ["| " + " | ".join(cell(c) for c in columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in rows]
    return "\n".join(lines)
