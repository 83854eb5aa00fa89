"""A group's round trip in phases: computed from the trainer's two clocks and the worker's three."""

from __future__ import annotations

import pytest

from fleetrl.broker import Timings
from fleetrl.trainer.metrics import TrainerMetrics
from fleetrl.trainer.round_trips import PHASES, RoundTrips, phases


def test_the_phases_split_the_round_trip_at_the_workers_three_times() -> None:
    got = phases(100.0, Timings(queued=100.2, started=100.5, finished=101.5), arrived=101.6)
    assert got == pytest.approx((0.2, 0.3, 1.0, 0.1))
    assert sum(got) == pytest.approx(1.6)  # they add up to the whole round trip
    assert phases(100.0, Timings(queued=0.0, started=100.5, finished=101.5), arrived=101.6) is None  # untimed


def test_each_step_logs_the_means_of_the_groups_since_the_last_and_the_histogram_keeps_them_all() -> None:
    metrics = TrainerMetrics()
    trips = RoundTrips(metrics)
    assert trips.summary() == {}
    for i, wait in enumerate((0.1, 0.5, 0.3)):
        trips.observe("r0", 10.0 * i, Timings(10.0 * i + 0.05, 10.0 * i + 0.05 + wait, 10.0 * i + 1.0), 10.0 * i + 1.5)
    trips.observe("r1", 0.0, Timings(), 5.0)  # untimed (an older worker): skipped
    assert trips.summary() == pytest.approx({"rt_to_worker": 0.05, "rt_wait": 0.3, "rt_generate": 0.65,
                                             "rt_back": 0.5})
    assert trips.summary() == {}  # started over
    trips.observe("r0", 0.0, Timings(1.0, 0.5, 2.0), 3.0)  # clocks apart: a negative phase is logged as is...
    assert trips.summary()["rt_wait"] == pytest.approx(-0.5)
    count = {ph: metrics.registry.get_sample_value("fleetrl_trainer_group_round_trip_seconds_count",
                                                   {"region": "r0", "phase": ph}) for ph in PHASES}
    assert count == dict.fromkeys(PHASES, 4.0)
    assert metrics.registry.get_sample_value("fleetrl_trainer_group_round_trip_seconds_count",
                                             {"region": "r1", "phase": "wait"}) is None
    # ... and observed as 0 (a histogram of durations): the wait's sum holds only the three real waits.
    assert metrics.registry.get_sample_value("fleetrl_trainer_group_round_trip_seconds_sum",
                                             {"region": "r0", "phase": "wait"}) == pytest.approx(0.9)
