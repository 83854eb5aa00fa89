"""TensorBoard (`report_to: [tensorboard]`, extra `tensorboard`): event files under
`<output_dir>/tensorboard/<run_name>/`, written with torch's `SummaryWriter`.

A resumed trainer opens the same folder with `purge_step` just past the last step an earlier writer
flushed (`delivered`), and is then sent again the steps released after it (session.py): TensorBoard
hides any partial copy of those an earlier writer left behind. Tables are Markdown text.
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
        purge = None
        if c.resume_step is not None:
            purge = min(c.delivered.get(self.name, c.resume_step), c.resume_step) + 1
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
