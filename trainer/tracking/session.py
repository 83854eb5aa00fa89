"""The trainer's side of tracking: which run, and when a step's figures are released.

A step's figures are held until a checkpoint covering the step is durable, then released to
`metrics.jsonl` and the trackers in step order (`release`, called right after the checkpoint is
committed). A trainer killed before that checkpoint redoes the step from the previous one, and only
the redone step's figures are ever written: no step appears twice in any tracker, nor in
`metrics.jsonl`. Figures lag by up to `trainer.checkpoint_every` steps (one, by default).

The checkpoint also carries the figures of the steps it covers that were not yet released when it was
written. A trainer killed between the checkpoint and the release finds them there and releases those
that `metrics.jsonl` (written synchronously at release, flushed line by line) does not hold yet. And
each tracker's feed notes the highest step it flushed (`delivered/<tracker>`): a resumed trainer sends
each tracker again the released steps after that mark, read back from metrics.jsonl, so what sat in a
queue or an SDK buffer at a SIGKILL is not lost either. A duplicate remains possible only for a kill
between a tracker's flush and its mark (TensorBoard hides it: `purge_step`).

Figures that are not a step's own (an evaluation's, reported at the step that published its version)
go through `deferred`, the same writer interface: they are held the same way, carried by the
checkpoint, and released with the next checkpoint that was written after they came (an evaluation
finished after the last checkpoint is finished again by a restarted trainer, from its re-read groups;
written at once it would appear twice).

The identity of the tracker run (a key: W&B's run id, MLflow's tag, with the run name) is part of the
checkpoint (`state`/`restore`), so a resumed trainer continues the same run; TensorBoard additionally
reopens with `purge_step` past the checkpoint's step.
"""

from __future__ import annotations

import json
import pathlib
import uuid
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from fleetrl.config import FleetConfig
from fleetrl.log import get_logger
from fleetrl.trainer.tracking.base import TrackerContext
from fleetrl.trainer.tracking.figures import SAMPLE_COLUMNS, make_decoder, sample_rows, step_figures
from fleetrl.trainer.tracking.writer import METRICS_FILE, ExperimentLog, NullExperimentLog, delivered_step

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

    t, directory = config.tracking, tracking_dir(config)
    delivered: dict[str, int] = {name: delivered_step(directory, name) for name in t.report_to}
    context = TrackerContext(directory, t, run_name, key, resume_step, run_params(config), delivered)
    return ExperimentLog(context.directory, build_trackers(context), queue_size=t.queue_size, on_drop=on_drop)


def run_params(config: FleetConfig) -> dict[str, Any]:
    """Flat hyperparameters logged with the tracker run."""
    params: dict[str, Any] = {"run": config.run, "model": config.model.path or "tiny"}
    for name, value in config.algorithm.model_dump(mode="json").items():
        params[f"algorithm.{name}"] = value
    return params


def tail_rows(path: pathlib.Path, tail_bytes: int = 1 << 20) -> list[dict[str, Any]]:
    """The rows in the last `tail_bytes` of metrics.jsonl (none when there is no file)."""
    try:
        with open(path, "rb") as f:
            f.seek(max(f.seek(0, 2) - tail_bytes, 0))
            lines = f.read().splitlines()
    except OSError:
        return []
    rows = []
    for line in lines:
        try:
            row = json.loads(line)
        except ValueError:  # the partial first line of the tail, or a line cut by a kill
            continue
        if isinstance(row, dict) and isinstance(row.get("step"), int):
            rows.append(row)
    return rows


def last_step_written(path: pathlib.Path) -> int:
    """The highest step of a scalars row near the end of metrics.jsonl (-1: none)."""
    return max((r["step"] for r in tail_rows(path) if "table" not in r), default=-1)


class TrainerTracking:
    """Step figures held until a checkpoint covers them; the tracker run's identity in the checkpoint."""

    def __init__(self, config: FleetConfig, on_drop: Callable[[str], None] | None = None) -> None:
        self.config, self._on_drop = config, on_drop
        self.key = uuid.uuid4().hex[:16]
        self.run_name = config.tracking.run_name or config.run
        self.resume_step: int | None = None
        self.log: ExperimentLog = NullExperimentLog()
        """The writer (also for other figures of the run, e.g. evals); `NullExperimentLog` until `start`."""
        self._pending: dict[int, tuple[dict[str, float], list[list[Any]] | None]] = {}
        """Step -> its figures and samples table rows, until released."""
        self._decode: Callable[[Sequence[int]], str] | None = None
        self._held: list[dict[str, Any]] = []
        """Records of `deferred` in arrival order: {"step", "figures"} or {"step", "table", "columns", "rows"}."""
        self._held_covered = 0
        """How many of `_held` the last checkpoint state holds (those `release` may write)."""
        self.deferred = _Deferred(self._held)
        """The writer for figures other than the steps' (evaluations): held until a checkpoint covers them."""

    def state(self) -> dict[str, Any]:
        """For the checkpoint: the tracker run, and the figures not released yet (those it covers)."""
        self._held_covered = len(self._held)
        return {"key": self.key, "run_name": self.run_name,
                "pending": [[step, figures, rows] for step, (figures, rows) in sorted(self._pending.items())],
                "held": list(self._held)}

    def restore(self, state: Mapping[str, Any] | None, step: int) -> None:
        """Continue the tracker run of a checkpoint (one written before tracking existed starts a new one)."""
        self.resume_step = step
        if state:
            self.key, self.run_name = str(state["key"]), str(state["run_name"])
            self._pending = {int(s): (dict(f), rows) for s, f, rows in state.get("pending", []) if int(s) <= step}
            self._held[:] = list(state.get("held", []))
            self._held_covered = len(self._held)

    def start(self) -> None:
        """Open metrics.jsonl and the trackers (each in its own thread: this returns at once)."""
        self.log = open_experiment_log(self.config, key=self.key, run_name=self.run_name,
                                       resume_step=self.resume_step, on_drop=self._on_drop)
        log.info("tracking.started", directory=str(self.log.directory), trackers=self.config.tracking.report_to,
                 run_name=self.run_name, key=self.key, resumed_at=self.resume_step)
        if self.resume_step is not None:
            self._catch_up(self.resume_step)
        elif last_step_written(tracking_dir(self.config) / METRICS_FILE) >= 0:
            log.warning("tracking.folder_reused", directory=str(self.log.directory),
                        note="a start without a checkpoint appends to an earlier run's metrics.jsonl and "
                             "TensorBoard folder; give tracking.output_dir a fresh folder to keep runs apart")

    def _catch_up(self, resume_step: int) -> None:
        """After a restart: to each tracker, the released steps it had not flushed (from metrics.jsonl);
        then the steps the checkpoint covers that were never released (from the checkpoint)."""
        directory = tracking_dir(self.config)
        rows = tail_rows(directory / METRICS_FILE)
        for name in self.config.tracking.report_to:
            after = delivered_step(directory, name)
            lost = [r for r in rows if after < r["step"] <= resume_step]
            if lost:
                log.info("tracking.resend", tracker=name, steps=len({r["step"] for r in lost}), after=after)
                self.log.resend(name, lost)
        written = max((r["step"] for r in rows if "table" not in r), default=-1)
        for step in [s for s in self._pending if s <= written]:
            del self._pending[step]
        # held figures already written (a kill between the checkpoint and its release): not again
        seen = {(r["step"], key) for r in rows if "table" not in r for key in r}
        kept = [h for h in self._held[:self._held_covered]
                if "figures" not in h or not all((h["step"], key) in seen for key in h["figures"])]
        self._held[:] = kept + self._held[self._held_covered:]
        self._held_covered = len(kept)
        self.release(resume_step)

    def record_step(self, step: int, version: int, groups: Sequence[Any], **figures_of: Any) -> None:
        """Hold step `step`'s figures (and, every `samples_every` steps, its samples table) until `release`."""
        figures = step_figures(version=version, groups=groups, **figures_of)
        for region in self.config.regions:  # a region that sent none this step: 0, not a gap in its curve
            figures.setdefault(f"train/groups/{region.name}", 0.0)
        rows = None
        every = self.config.tracking.samples_every
        if every and step % every == 0:
            if self._decode is None:
                self._decode = make_decoder(self.config.model.tokenizer_source)
            rows = sample_rows(step, version, groups, self.config.tracking.samples_rows, self._decode)
        self._pending[step] = (figures, rows)

    def release(self, step: int) -> None:
        """A checkpoint covering `step` is durable: write the figures of every step up to it, in order,
        then the held ones its state carried."""
        for s in sorted(k for k in self._pending if k <= step):
            figures, rows = self._pending.pop(s)
            self.log.scalars(s, figures)
            if rows is not None:
                self.log.table(s, SAMPLES_TABLE, SAMPLE_COLUMNS, rows)
        covered, self._held_covered = self._held[:self._held_covered], 0
        del self._held[:len(covered)]
        for h in covered:
            if "figures" in h:
                self.log.scalars(int(h["step"]), h["figures"])
            else:
                self.log.table(int(h["step"]), h["table"], h["columns"], h["rows"])

    def close(self, timeout_s: float | None = None) -> None:
        if self._pending:  # steps no checkpoint covers (a failed run): they will be redone, not written
            log.info("tracking.unreleased", steps=sorted(self._pending))
        self.log.close(self.config.tracking.close_timeout_s if timeout_s is None else timeout_s)


class _Deferred:
    """`ExperimentLog`'s writing half over a list that `TrainerTracking` releases at its checkpoints."""

    def __init__(self, held: list[dict[str, Any]]) -> None:
        self._held = held

    def scalars(self, step: int, figures: Mapping[str, float]) -> None:
        self._held.append({"step": step, "figures": {k: float(v) for k, v in figures.items()}})

    def table(self, step: int, name: str, columns: Sequence[str], rows: Sequence[Sequence[Any]]) -> None:
        self._held.append({"step": step, "table": name, "columns": list(columns), "rows": [list(r) for r in rows]})
