"""trackio (`report_to: [trackio]`, extra `trackio`): Hugging Face's local-first tracker, a SQLite store
under `<output_dir>/trackio/` (its `TRACKIO_DIR`, unless that is set) that `trackio show` serves.

trackio reads `TRACKIO_DIR` when it is first imported, so the folder is set just before that import; a
process that imported trackio before keeps trackio's folder. A resumed trainer continues the run of
the same name (`resume="allow"`).
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import Any

from fleetrl.trainer.tracking.base import Tracker


class TrackioTracker(Tracker):
    name = "trackio"

    def open(self) -> None:
        c = self.context
        os.environ.setdefault("TRACKIO_DIR", str(c.directory / "trackio"))
        import trackio

        self.run = trackio.init(project=c.settings.project, name=c.run_name, resume="allow", config=dict(c.params),
                                embed=False, auto_log_gpu=False, auto_log_cpu=False)
        self._table = trackio.Table

    def scalars(self, step: int, figures: Mapping[str, float]) -> None:
        self.run.log(dict(figures), step=step)

    def table(self, step: int, name: str, columns: Sequence[str], rows: Sequence[Sequence[Any]]) -> None:
        self.run.log({name: self._table(columns=list(columns), data=[list(r) for r in rows])}, step=step)

    def close(self) -> None:
        self.run.finish()
