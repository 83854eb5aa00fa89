"""The demo restarts a daemon that fails on its own as the packaged units' `Restart=on-failure` would: with a
doubling backoff, and a start limit after which the failure is fatal (no servers; real child processes)."""

from __future__ import annotations

import pathlib
import sys
from collections.abc import Iterator

import pytest
from slowdown import scaled

from fleetrl.demo.procs import Child
from fleetrl.demo.supervision import BACKOFF_MAX_S, HEALTHY_AFTER_S, START_LIMIT, OnFailure

STARTED: list[Child] = []


@pytest.fixture(autouse=True)
def _close_logs() -> Iterator[None]:
    yield
    while STARTED:
        child = STARTED.pop()
        child.wait_or_kill(0.0)  # each has exited already; this closes its log


def _failing(tmp_path: pathlib.Path, name: str = "trainer") -> Child:
    child = Child(name, [sys.executable, "-c", "print('boom'); raise SystemExit(1)"], tmp_path / f"{name}.log", {})
    child.start()
    STARTED.append(child)
    assert child.proc is not None and child.proc.wait(timeout=scaled(30)) == 1
    return child


def test_failures_in_a_row_back_off_then_hit_the_start_limit(tmp_path: pathlib.Path) -> None:
    child = _failing(tmp_path)
    policy = OnFailure()
    now = 1000.0
    delays = []
    for _ in range(START_LIMIT):
        restart = policy.failed(child, now)
        assert restart is not None and policy.waiting(child)
        assert policy.failed(child, now) is restart  # the same failure seen twice is one failure
        assert policy.due(restart.due - 0.01) == []  # not before its backoff
        assert policy.due(restart.due) == [child] and not policy.waiting(child)
        delays.append(restart.delay_s)
        now = restart.due + 1.0  # it fails again a second after its restart
    assert delays == [1.0, 2.0, 4.0, 8.0, 16.0][:START_LIMIT]
    assert all(d <= BACKOFF_MAX_S for d in delays)
    assert policy.failed(child, now) is None  # past the start limit: fatal


def test_a_healthy_run_resets_the_count_and_each_daemon_counts_alone(tmp_path: pathlib.Path) -> None:
    trainer, replicator = _failing(tmp_path, "trainer"), _failing(tmp_path, "replicator-local-a")
    policy = OnFailure()
    first = policy.failed(trainer, 0.0)
    assert first is not None and policy.due(first.due) == [trainer]
    second = policy.failed(trainer, first.due + 1.0)
    assert second is not None and second.failure == 2 and second.delay_s == 2.0
    assert policy.due(second.due) == [trainer]
    again = policy.failed(trainer, second.due + HEALTHY_AFTER_S)  # it ran a healthy while before this one
    assert again is not None and again.failure == 1 and again.delay_s == 1.0
    other = policy.failed(replicator, 0.0)
    assert other is not None and other.failure == 1


def test_a_due_restart_runs_the_same_command_into_the_same_log(tmp_path: pathlib.Path) -> None:
    child = _failing(tmp_path)
    policy = OnFailure()
    restart = policy.failed(child, 0.0)
    assert restart is not None
    (due,) = policy.due(restart.due)
    due.restart()
    assert due.proc is not None and due.proc.wait(timeout=scaled(30)) == 1
    due.wait_or_kill(0.0)
    assert child.starts == 2 and child.log_path.read_text().count("boom") == 2
