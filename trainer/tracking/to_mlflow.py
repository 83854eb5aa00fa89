"""MLflow (`report_to: [mlflow]`, extra `mlflow`: the client alone, `mlflow-skinny`).

The run is found again after a restart by its tag `fleetrl.tracking_key` (the key kept in the trainer's
checkpoint) in the experiment `tracking.project`; a first start creates it and logs the
hyperparameters. Figures go in one `log_batch` per step, tables as JSON artifacts under `tables/`. HTTP requests
are bounded (`tracking.mlflow_request_timeout_s`, at most 2 retries unless MLFLOW_HTTP_REQUEST_* say
otherwise). An HTTP server that does not accept a connection fails `open` at once, before the SDK is
even imported (an import of a few CPU seconds the trainer would share its cores with); one that accepts
and then fails costs at most a few bounded requests. Either way, in the tracker's own thread, and the
tracker is disabled.
"""

from __future__ import annotations

import os
import socket
import time
import urllib.parse
from collections.abc import Mapping, Sequence
from typing import Any

from fleetrl.trainer.tracking.base import Tracker

KEY_TAG = "fleetrl.tracking_key"


def _check_reachable(uri: str | None, timeout_s: float) -> None:
    """Raise `ConnectionError` when an http(s) tracking server does not accept a TCP connection."""
    if uri is None:
        return
    parts = urllib.parse.urlsplit(uri)
    if parts.scheme not in ("http", "https") or parts.hostname is None:
        return
    port = parts.port or (443 if parts.scheme == "https" else 80)
    try:
        socket.create_connection((parts.hostname, port), timeout=timeout_s).close()
    except OSError as exc:
        raise ConnectionError(f"MLflow tracking server {uri} does not answer: {exc}") from exc


class MlflowTracker(Tracker):
    name = "mlflow"

    def open(self) -> None:
        c = self.context
        _check_reachable(c.settings.mlflow_tracking_uri or os.environ.get("MLFLOW_TRACKING_URI"),
                         c.settings.mlflow_request_timeout_s)
        os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "2")
        os.environ.setdefault("MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR", "1")
        os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", str(int(max(c.settings.mlflow_request_timeout_s, 1))))
        from mlflow.entities import Param
        from mlflow.tracking import MlflowClient

        self.client = MlflowClient(tracking_uri=c.settings.mlflow_tracking_uri)
        experiment = self.client.get_experiment_by_name(c.settings.project)
        experiment_id = (experiment.experiment_id if experiment is not None
                         else self.client.create_experiment(c.settings.project))
        found = self.client.search_runs([experiment_id], filter_string=f"tags.`{KEY_TAG}` = '{c.key}'",
                                        max_results=1)
        if found:
            self.run_id = found[0].info.run_id
        else:
            run = self.client.create_run(experiment_id, run_name=c.run_name, tags={KEY_TAG: c.key})
            self.run_id = run.info.run_id
            params = [Param(k[:250], str(v)[:6000]) for k, v in c.params.items()]
            for i in range(0, len(params), 100):
                self.client.log_batch(self.run_id, params=params[i:i + 100])

    def scalars(self, step: int, figures: Mapping[str, float]) -> None:
        from mlflow.entities import Metric

        ts = int(time.time() * 1000)
        metrics = [Metric(k, v, ts, step) for k, v in figures.items()]
        for i in range(0, len(metrics), 1000):  # the server's limit per batch
            self.client.log_batch(self.run_id, metrics=metrics[i:i + 1000])

    def table(self, step: int, name: str, columns: Sequence[str], rows: Sequence[Sequence[Any]]) -> None:
        # The JSON layout of MLflow's own `log_table` (`columns`, `data`), without its pandas round trip.
        table = {"columns": list(columns), "data": [list(r) for r in rows]}
        self.client.log_dict(self.run_id, table, f"tables/{name}-step-{step:09d}.json")

    def close(self) -> None:
        self.client.set_terminated(self.run_id)
