"""The experiment writer (trainer/tracking/): metrics.jsonl, bounded queues that drop and count instead of
waiting, a failing tracker disabled once, and the trainer's release rule (figures of a step leave only
once a checkpoint covers it; the checkpoint carries what it covers and was not released)."""

from __future__ import annotations

import json
import pathlib
import threading
from collections.abc import Mapping, Sequence
from typing import Any

import pytest
from pydantic import ValidationError
from slowdown import scaled

from fleetrl.config import FleetConfig, TrackingConfig
from fleetrl.rollout.tasks.tokenizer import CharTokenizer
from fleetrl.trainer.tracking import ExperimentLog, NullExperimentLog, Tracker, TrackerContext, TrainerTracking
from fleetrl.trainer.tracking.feed import TrackerFeed
from fleetrl.trainer.tracking.figures import char_decode
from fleetrl.trainer.tracking.session import last_step_written


class ListTracker(Tracker):
    """An in-memory tracker (the transport interface's test implementation): it records what it gets."""

    name = "list"

    def __init__(self, gate: threading.Event | None = None, fail_at: str | None = None) -> None:
        super().__init__(TrackerContext(pathlib.Path("."), TrackingConfig(), "r", "k"))
        self.gate, self.fail_at = gate, fail_at
        self.rows: list[tuple[int, dict[str, float]]] = []
        self.tables: list[tuple[int, str]] = []
        self.calls: list[str] = []

    def open(self) -> None:
        self.calls.append("open")
        if self.fail_at == "open":
            raise ConnectionError("server unreachable")

    def scalars(self, step: int, figures: Mapping[str, float]) -> None:
        if self.gate is not None:
            assert self.gate.wait(scaled(30))
        if self.fail_at == "scalars":
            raise RuntimeError("boom")
        self.rows.append((step, dict(figures)))

    def table(self, step: int, name: str, columns: Sequence[str], rows: Sequence[Sequence[Any]]) -> None:
        self.tables.append((step, name))

    def close(self) -> None:
        self.calls.append("close")


def _jsonl(path: pathlib.Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (path / "metrics.jsonl").read_text().splitlines()]


def test_every_record_goes_to_metrics_jsonl_and_to_each_tracker_in_order(tmp_path: pathlib.Path) -> None:
    tracker = ListTracker()
    log = ExperimentLog(tmp_path, [tracker])
    for step in (1, 2, 3):
        log.scalars(step, {"train/loss": step / 2, "train/kl": float("nan")})
    log.table(3, "samples", ["a", "b"], [[1, "x"], [2, "y"]])
    log.close(scaled(10))
    assert [s for s, _ in tracker.rows] == [1, 2, 3] and tracker.tables == [(3, "samples")]
    assert tracker.calls == ["open", "close"]
    rows = _jsonl(tmp_path)
    assert rows[0] == {"step": 1, "train/loss": 0.5, "train/kl": None}  # NaN is no JSON: null
    assert rows[3] == {"step": 3, "table": "samples", "columns": ["a", "b"], "rows": [[1, "x"], [2, "y"]]}
    assert last_step_written(tmp_path / "metrics.jsonl") == 3
    with pytest.raises(ValueError, match=r"ExperimentLog.table\('t'\): row 0 has 1 values for 2 columns"):
        ExperimentLog(None).table(1, "t", ["a", "b"], [[1]])


def test_a_full_queue_drops_and_counts_and_never_waits(tmp_path: pathlib.Path) -> None:
    gate = threading.Event()
    tracker = ListTracker(gate=gate)
    dropped: list[str] = []
    log = ExperimentLog(tmp_path, [tracker], queue_size=2, on_drop=dropped.append)
    for step in range(1, 11):  # the tracker is stuck on its first record: 2 wait, the rest are dropped
        log.scalars(step, {"x": 1.0})
    assert len(_jsonl(tmp_path)) == 10  # the local record is complete
    gate.set()
    log.close(scaled(10))
    written = [s for s, _ in tracker.rows]
    assert written[0] == 1 and len(written) + len(dropped) == 10 and len(dropped) >= 7
    assert log.dropped() == {"list": len(dropped)} and set(dropped) == {"list"}


@pytest.mark.parametrize("fail_at", ["open", "scalars"])
def test_a_failing_tracker_is_logged_once_and_disabled(tmp_path: pathlib.Path, fail_at: str,
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    bad, good = ListTracker(fail_at=fail_at), ListTracker()
    log = ExperimentLog(tmp_path, [bad, good])
    for step in range(1, 6):
        log.scalars(step, {"x": float(step)})
    log.close(scaled(10))
    assert [s for s, _ in good.rows] == [1, 2, 3, 4, 5]  # the other tracker and the trainer go on
    assert bad.rows == [] and "close" not in bad.calls
    assert list(log.failed()) == ["list"]
    err = capsys.readouterr()
    assert (err.out + err.err).count("tracking.tracker_failed") == 1


def test_the_null_log_writes_nothing(tmp_path: pathlib.Path) -> None:
    log = NullExperimentLog()
    log.scalars(1, {"x": 1.0})
    log.table(1, "t", ["a"], [[1]])
    log.close()
    assert log.failed() == {} and log.dropped() == {}


def test_a_feed_close_is_bounded_when_its_tracker_hangs() -> None:
    gate = threading.Event()
    feed = TrackerFeed(ListTracker(gate=gate), queue_size=1)
    feed.put(1, lambda t: t.scalars(1, {}))
    assert feed.close(0.2) is False  # left to its daemon thread
    gate.set()


def _fleet(tmp_path: pathlib.Path, **tracking: Any) -> FleetConfig:
    return FleetConfig.model_validate({
        "run": "trk", "trainer": {"checkpoint_dir": str(tmp_path / "ckpt")}, "tracking": tracking,
        "regions": [{"name": "a", "kafka": "127.0.0.1:1", "store": str(tmp_path / "a")}]})


def test_figures_leave_only_once_a_checkpoint_covers_them_and_a_resume_releases_what_it_carries(
        tmp_path: pathlib.Path) -> None:
    config = _fleet(tmp_path)
    first = TrainerTracking(config)
    first.start()
    for step in (1, 2, 3):
        first._pending[step] = ({"train/loss": float(step)}, None)
    first.release(2)  # the checkpoint of step 2
    state = first.state()  # what a checkpoint of step 3 carries (written before its release) ...
    first.log.close()  # ... and the trainer is killed before releasing step 3
    assert [r["step"] for r in _jsonl(tmp_path / "ckpt" / "tracking")] == [1, 2]
    assert [s for s, _, _ in state["pending"]] == [3]
    resumed = TrainerTracking(config)
    resumed.restore(state, 3)
    assert resumed.key == first.key
    resumed.start()
    resumed.close()
    assert [r["step"] for r in _jsonl(tmp_path / "ckpt" / "tracking")] == [1, 2, 3]
    again = TrainerTracking(config)  # killed once more right after that release: nothing twice
    again.restore(state, 3)
    again.start()
    again.close()
    assert [r["step"] for r in _jsonl(tmp_path / "ckpt" / "tracking")] == [1, 2, 3]


def test_an_evaluations_figures_leave_with_the_checkpoint_after_them_and_never_twice(tmp_path: pathlib.Path) -> None:
    """`deferred` (the evaluations' writer): figures reported at an earlier step are held until a checkpoint
    written after they came is durable; one that comes while that checkpoint is being written waits for
    the next; a restart releases what its checkpoint carried, unless metrics.jsonl already holds it."""
    config = _fleet(tmp_path)
    first = TrainerTracking(config)
    first.start()
    first.deferred.scalars(2, {"eval/held/pass@1": 0.25})
    first.deferred.table(2, "eval/held", ["set", "pass@1"], [["held", 0.25]])
    first.release(4)  # no checkpoint state was taken since they came: they stay held
    assert _jsonl(tmp_path / "ckpt" / "tracking") == []
    state = first.state()  # the checkpoint of step 4 holds both
    first.deferred.scalars(4, {"eval/held/pass@1": 0.5})  # came while that checkpoint was written
    first.release(4)
    rows = _jsonl(tmp_path / "ckpt" / "tracking")
    assert [(r["step"], r.get("eval/held/pass@1"), r.get("table")) for r in rows] == [
        (2, 0.25, None), (2, None, "eval/held")]
    first.log.close()  # killed: the step-4 evaluation no checkpoint covers is finished again after a restart

    resumed = TrainerTracking(config)
    resumed.restore(state, 4)  # metrics.jsonl holds the step-2 figures already: not again
    resumed.start()
    resumed.close()
    assert [(r["step"], r.get("eval/held/pass@1")) for r in _jsonl(tmp_path / "ckpt" / "tracking")
            if "table" not in r] == [(2, 0.25)]


def test_char_decode_is_the_char_tokenizers() -> None:
    tok = CharTokenizer()
    ids = [*tok.encode("Hello, world!\n~ ?", bos=True), 2, 5, 6]
    assert char_decode(ids) == tok.decode(ids) == "Hello, world!\n~ ?"


@pytest.mark.parametrize(("tracking", "field"), [
    ({"report_to": ["tensorbord"]}, "report_to"),
    ({"report_to": ["wandb", "wandb"]}, "report_to"),
    ({"mlflow_tracking_uri": "ftp://x"}, "mlflow_tracking_uri"),
    ({"queue_size": 0}, "queue_size"),
    ({"samples_every": -1}, "samples_every"),
    ({"wandb_mode": "cloud"}, "wandb_mode"),
])
def test_a_bad_tracking_section_is_refused_naming_the_field(tmp_path: pathlib.Path, tracking: dict[str, Any],
                                                            field: str) -> None:
    with pytest.raises(ValidationError) as err:
        _fleet(tmp_path, **tracking)
    assert err.value.errors()[0]["loc"][:2] == ("tracking", field)


def test_a_resume_sends_each_tracker_again_what_it_had_not_flushed(tmp_path: pathlib.Path) -> None:
    """Steps 2 and 3 were released (metrics.jsonl) but TensorBoard's feed had flushed only step 1 when the
    trainer died: the resumed trainer sends it 2 and 3 again, and TensorBoard shows each step once."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    config = _fleet(tmp_path, report_to=["tensorboard"])
    first = TrainerTracking(config)
    first.start()
    for step in (1, 2, 3):
        first._pending[step] = ({"train/loss": float(step)}, None)
        first.release(step)
    first.close()
    folder = tmp_path / "ckpt" / "tracking"
    assert (folder / "delivered" / "tensorboard").read_text() == "3"
    (folder / "delivered" / "tensorboard").write_text("1")  # as if killed before steps 2 and 3 were flushed
    resumed = TrainerTracking(config)
    resumed.restore(first.state(), 3)
    resumed.start()
    resumed.close()
    assert (folder / "delivered" / "tensorboard").read_text() == "3"
    assert [r["step"] for r in _jsonl(folder)] == [1, 2, 3]  # the local record is not written again
    acc = EventAccumulator(str(folder / "tensorboard" / "trk"))
    acc.Reload()
    assert [(e.step, e.value) for e in acc.Scalars("train/loss")] == [(1, 1.0), (2, 2.0), (3, 3.0)]
    raw = EventAccumulator(str(folder / "tensorboard" / "trk"), purge_orphaned_data=False)
    raw.Reload()
    assert [e.step for e in raw.Scalars("train/loss")] == [1, 2, 3, 2, 3]  # sent again, older copies purged


def test_config_check_refuses_a_bad_tracker_naming_the_field(tmp_path: pathlib.Path) -> None:
    import subprocess
    import sys

    import yaml

    doc = yaml.safe_load((pathlib.Path(__file__).parents[2] / "examples" / "fleet.demo.yaml").read_text())
    doc["tracking"] = {"report_to": ["tensorboard", "tensorbord"]}
    path = tmp_path / "fleet.yaml"
    path.write_text(yaml.safe_dump(doc))
    out = subprocess.run([sys.executable, "-m", "fleetrl.cli", "config", "check", str(path)], capture_output=True,
                         text=True, timeout=scaled(60))
    assert out.returncode != 0 and "tracking.report_to[1]" in out.stderr, out.stderr
