"""Each tracker against its real library, read back with that library's own reader: TensorBoard's
`EventAccumulator`, a real `mlflow server` (sqlite, a free loopback port) through `MlflowClient`, W&B's
offline files (no network) and trackio's local store. A resumed writer continues the same run."""

from __future__ import annotations

import json
import os
import pathlib
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from typing import Any

import pytest
import wandb_reader
from slowdown import scaled

from fleetrl import devstack
from fleetrl.config import TrackingConfig
from fleetrl.trainer.tracking import ExperimentLog, TrackerContext
from fleetrl.trainer.tracking.trackers import build_trackers

FIGURES = {"train/loss": 0.25, "train/reward_mean": 0.5}
COLUMNS = ["step", "completion", "reward"]


def _write(directory: pathlib.Path, settings: TrackingConfig, steps: range, *, key: str = "k1",
           resume_step: int | None = None, table_at: int | None = None) -> ExperimentLog:
    context = TrackerContext(directory, settings, "run-a", key, resume_step, {"algorithm.lr": 0.001})
    log = ExperimentLog(directory, build_trackers(context))
    for step in steps:
        log.scalars(step, {"train/loss": step / 4, "train/reward_mean": step / 10})
        if step == table_at:
            log.table(step, "samples", COLUMNS, [[step, "cba", 1.0], [step, "a|b", 0.0]])
    log.close(scaled(120))
    assert log.failed() == {}, log.failed()
    return log


def test_tensorboard_event_files_read_back_and_a_resume_purges_past_the_checkpoint(tmp_path: pathlib.Path) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    settings = TrackingConfig(report_to=["tensorboard"])
    _write(tmp_path, settings, range(1, 5), table_at=3)
    # A writer killed after step 4, resumed from a checkpoint of step 2: steps 3 and 4 are redone.
    _write(tmp_path, settings, range(3, 6), resume_step=2)
    acc = EventAccumulator(str(tmp_path / "tensorboard" / "run-a"))
    acc.Reload()
    for tag in FIGURES:
        events = acc.Scalars(tag)
        assert [e.step for e in events] == [1, 2, 3, 4, 5], tag
    assert acc.Scalars("train/loss")[-1].value == pytest.approx(5 / 4)
    assert any(t.startswith("samples") for t in acc.Tags()["tensors"])


@pytest.fixture
def mlflow_server(tmp_path: pathlib.Path) -> Iterator[str]:
    port = devstack.free_port()
    mlflow = pathlib.Path(sys.executable).with_name("mlflow")
    url = f"http://127.0.0.1:{port}"
    with open(tmp_path / "mlflow.log", "wb") as server_log:
        # Its own process group: the server runs its workers as children, stopped with it below.
        proc = subprocess.Popen(
            [str(mlflow), "server", "--backend-store-uri", f"sqlite:///{tmp_path / 'mlflow.db'}",
             "--artifacts-destination", str(tmp_path / "artifacts"), "--host", "127.0.0.1", "--port", str(port),
             "--workers", "1"],
            stdout=subprocess.DEVNULL, stderr=server_log, cwd=tmp_path, start_new_session=True)
    try:
        deadline = time.monotonic() + scaled(90)
        while True:
            try:
                with urllib.request.urlopen(f"{url}/health", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"mlflow server did not start: {(tmp_path / 'mlflow.log').read_text()[-2000:]}")
            time.sleep(0.2)
        yield url
    finally:
        os.killpg(proc.pid, signal.SIGTERM)  # the group this fixture started, by its id
        try:
            proc.wait(scaled(20))
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


@pytest.mark.integration
@pytest.mark.slow  # the server's start (sqlite migrations) takes 10-25 s on 2 shared cores
def test_mlflow_server_run_read_back_with_mlflow_client_and_continued_on_resume(
        mlflow_server: str, tmp_path: pathlib.Path) -> None:
    from mlflow.tracking import MlflowClient

    settings = TrackingConfig(report_to=["mlflow"], mlflow_tracking_uri=mlflow_server, project="fleet-exp")
    _write(tmp_path, settings, range(1, 4), table_at=2)
    _write(tmp_path, settings, range(4, 6), resume_step=3)  # the same key: the same MLflow run goes on
    client = MlflowClient(mlflow_server)
    experiment = client.get_experiment_by_name("fleet-exp")
    assert experiment is not None
    (run,) = client.search_runs([experiment.experiment_id])
    assert run.info.run_name == "run-a" and run.data.params["algorithm.lr"] == "0.001"
    history = client.get_metric_history(run.info.run_id, "train/loss")
    assert sorted(m.step for m in history) == [1, 2, 3, 4, 5]
    assert {m.step: m.value for m in history}[5] == pytest.approx(5 / 4)
    tables = [a.path for a in client.list_artifacts(run.info.run_id, "tables")]
    assert tables == ["tables/samples-step-000000002.json"]


def test_wandb_offline_history_read_back_from_its_files_and_continued_on_resume(
        tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WANDB_SILENT", "true")
    settings = TrackingConfig(report_to=["wandb"], wandb_mode="offline")
    _write(tmp_path, settings, range(1, 4), table_at=3)
    # W&B names an offline run's folder by its start time to the second and the run id: a trainer resumed
    # within the same second (only here, where nothing happens in between) would write into the same one.
    started = int(time.time())
    while int(time.time()) == started:  # ends within a second by construction
        time.sleep(0.05)
    _write(tmp_path, settings, range(4, 6), resume_step=3)
    runs = sorted((tmp_path / "wandb").glob("offline-run-*"))
    assert len(runs) >= 1 and all(r.name.endswith("-k1") for r in runs)  # one W&B run id, `wandb sync` merges
    rows = [row for r in runs for row in wandb_reader.history(r)]
    losses = {row["trainer/step"]: row["train/loss"] for row in rows if "train/loss" in row}
    assert losses == {s: s / 4 for s in range(1, 6)}
    tables = [row for row in rows if "samples/_type" in row]
    assert len(tables) == 1 and tables[0]["samples/_type"] == "table-file" and tables[0]["trainer/step"] == 3


_TRACKIO_SCRIPT = """
import json, pathlib, sys
from fleetrl.config import TrackingConfig
from fleetrl.trainer.tracking import ExperimentLog, TrackerContext
from fleetrl.trainer.tracking.trackers import build_trackers
directory, first, last, resume = pathlib.Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
context = TrackerContext(directory, TrackingConfig(report_to=["trackio"], project="fleet-exp"), "run-a", "k1",
                         int(resume) if resume != "-" else None)
log = ExperimentLog(directory, build_trackers(context))
for step in range(first, last + 1):
    log.scalars(step, {"train/loss": step / 4})
log.close(120)
from trackio.sqlite_storage import SQLiteStorage
print(json.dumps({"failed": log.failed(), "runs": SQLiteStorage.get_runs("fleet-exp"),
                  "logs": SQLiteStorage.get_logs("fleet-exp", "run-a")}, default=str))
"""


def test_trackio_local_store_read_back_and_continued_on_resume(tmp_path: pathlib.Path) -> None:
    """In a child process: trackio fixes its store folder (TRACKIO_DIR) when it is first imported."""
    def run(first: int, last: int, resume: str) -> dict[str, Any]:
        env = {k: v for k, v in os.environ.items() if k != "TRACKIO_DIR"}
        out = subprocess.run([sys.executable, "-c", _TRACKIO_SCRIPT, str(tmp_path), str(first), str(last), resume],
                             capture_output=True, text=True, timeout=scaled(120), env=env, cwd=tmp_path)
        assert out.returncode == 0, out.stderr[-2000:]
        return dict(json.loads(out.stdout.strip().splitlines()[-1]))

    run(1, 3, "-")
    result = run(4, 5, "3")
    assert result["failed"] == {} and result["runs"] == ["run-a"]
    steps = [row["step"] for row in result["logs"] if "train/loss" in row]
    assert steps == [1, 2, 3, 4, 5]
    assert (tmp_path / "trackio").is_dir()
