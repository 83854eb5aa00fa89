"""Weights & Biases (`report_to: [wandb]`, extra `wandb`), offline by default (`tracking.wandb_mode`):
the run is written under `<output_dir>/wandb/` for `wandb sync`, with no network.

The W&B run id is the key kept in the trainer's checkpoint, with `resume="allow"`: a resumed trainer
continues the same run. Every figure is plotted against `trainer/step` (`define_metric`, as TRL does),
not W&B's own step counter, so figures logged later for an earlier step (an eval of an older version)
are accepted.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from fleetrl.trainer.tracking.base import Tracker

STEP_KEY = "trainer/step"


class WandbTracker(Tracker):
    name = "wandb"

    def open(self) -> None:
        import wandb

        c = self.context
        folder = c.directory
        folder.mkdir(parents=True, exist_ok=True)
        self.run = wandb.init(
            project=c.settings.project, name=c.run_name, id=c.key, resume="allow", dir=str(folder),
            mode=c.settings.wandb_mode, config=dict(c.params),
            settings=wandb.Settings(silent=True, console="off", x_disable_stats=True),
        )
        self.run.define_metric(STEP_KEY)
        self.run.define_metric("*", step_metric=STEP_KEY)
        self._table = wandb.Table

    def scalars(self, step: int, figures: Mapping[str, float]) -> None:
        self.run.log({STEP_KEY: step, **figures})

    def table(self, step: int, name: str, columns: Sequence[str], rows: Sequence[Sequence[Any]]) -> None:
        self.run.log({STEP_KEY: step, name: self._table(columns=list(columns), data=[list(r) for r in rows])})

    def close(self) -> None:
        self.run.finish()
