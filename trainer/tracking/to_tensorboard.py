"""TensorBoard (`report_to: [tensorboard]`, extra `tensorboard`): event files under
`<output_dir>/tensorboard/<run_name>/`, written with torch's `SummaryWriter`.

A resumed trainer opens the same folder with `purge_step` = the checkpoint's step + 1, so that even
events written past the checkpoint by an older writer would be hidden; none are, since the trainer
releases a step only once a checkpoint covers it (docs/tracking.md). Tables are Markdown text.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from fleetrl.trainer.tracking.base import Tracker, markdown_table


class TensorBoardTracker(Tracker):
    name = "tensorboard"

    def open(self) -> None:
        from torch.utils.tensorboard import SummaryWriter  # needs the `tensorboard` package

        c = self.context
        self.folder = c.directory / "tensorboard" / c.run_name
        purge = c.resume_step + 1 if c.resume_step is not None else None
        self.writer = SummaryWriter(log_dir=str(self.folder), purge_step=purge, flush_secs=30)

    def scalars(self, step: int, figures: Mapping[str, float]) -> None:
        for name, value in figures.items():
            self.writer.add_scalar(name, value, global_step=step)

    def table(self, step: int, name: str, columns: Sequence[str], rows: Sequence[Sequence[Any]]) -> None:
        self.writer.add_text(name, markdown_table(columns, rows), global_step=step)

    def flush(self) -> None:
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()
