"""LogBudget: a flood of one event is a bounded number of log lines, and no event goes uncounted."""

from __future__ import annotations

import pytest
from structlog.testing import capture_logs

from fleetrl.log import LogBudget, get_logger


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_a_flood_is_logged_up_to_the_budget_and_the_rest_counted_in_one_line_per_window() -> None:
    clock = Clock()
    budget = LogBudget("thing.refused", per_window=3, window_s=10.0, clock=clock)
    log = get_logger("test")
    with capture_logs() as logs:
        for i in range(10):
            budget.warning(log, "bad" if i % 2 else "worse", n=i)
        clock.now += 10.0  # the next event opens a new window and flushes the last one's counts
        budget.warning(log, "bad", n=10)
        budget.flush(log)
        budget.flush(log)  # nothing more to say
    events = [(e["event"], e.get("n"), e.get("count"), e.get("by")) for e in logs]
    assert events == [
        ("thing.refused", 0, None, None), ("thing.refused", 1, None, None), ("thing.refused", 2, None, None),
        ("thing.refused.suppressed", None, 7, {"bad": 4, "worse": 3}),
        ("thing.refused", 10, None, None),
    ]


def test_events_under_the_budget_are_each_logged_and_nothing_is_suppressed() -> None:
    clock = Clock()
    budget = LogBudget("thing.refused", per_window=5, window_s=1.0, clock=clock)
    log = get_logger("test")
    with capture_logs() as logs:
        for i in range(12):  # 4 per window, 3 windows
            budget.warning(log, "bad", n=i)
            clock.now += 0.26
        budget.flush(log)
    assert [e["n"] for e in logs] == list(range(12))


def test_a_budget_refuses_a_nonsense_window() -> None:
    with pytest.raises(ValueError, match="window_s"):
        LogBudget("x", window_s=0)
