"""The suite's fleet slots (tests/fleet_slots.py): a test running two fleets holds two slots, and waits
for them without blocking anyone forever."""

from __future__ import annotations

import pathlib
import threading

import fleet_slots
import pytest
from slowdown import scaled


def test_a_two_fleet_holder_waits_for_both_slots_and_then_excludes_a_third_fleet(tmp_path: pathlib.Path) -> None:
    warnings: list[str] = []
    first_in = threading.Event()
    release_first = threading.Event()
    pair_in = threading.Event()

    def single() -> None:
        with fleet_slots.hold(1, 2, scaled(30), warnings.append, tmp_path, poll_s=0.01) as held:
            assert held == 1
            first_in.set()
            assert release_first.wait(scaled(30))

    def pair() -> None:
        with fleet_slots.hold(2, 2, scaled(30), warnings.append, tmp_path, poll_s=0.01) as held:
            assert held == 2
            pair_in.set()

    one = threading.Thread(target=single)
    one.start()
    assert first_in.wait(scaled(30))
    two = threading.Thread(target=pair)
    two.start()
    # one slot of two is free, but the pair needs both: it must not run while the single holder does
    assert not pair_in.wait(0.3)
    release_first.set()
    one.join(scaled(30))
    assert pair_in.wait(scaled(30)), "the pair never got both slots once they were free"
    two.join(scaled(30))
    assert warnings == []

    # while the pair holds both, a single fleet test finds none free (and runs, warned, after its bound)
    with fleet_slots.hold(2, 2, scaled(30), warnings.append, tmp_path) as held:
        assert held == 2
        with fleet_slots.hold(1, 2, 0.2, warnings.append, tmp_path, poll_s=0.01) as got:
            assert got == 0
    assert warnings == ["1 of 1 fleet slot(s) not free after 0 s: running without them"]


def test_a_holder_wanting_more_than_there_are_takes_them_all(tmp_path: pathlib.Path) -> None:
    with fleet_slots.hold(3, 2, scaled(10), lambda text: None, tmp_path) as held:
        assert held == 2


def test_slots_follow_the_factor_and_one_machine_gets_one_count(monkeypatch: pytest.MonkeyPatch) -> None:
    """Two per reference core on 2 cores; a 2.5x quota, which measures 2.15-2.72x, gets 2 slots every time."""
    import slowdown

    monkeypatch.setattr(slowdown, "_cores", lambda: 2)
    seen: dict[float, int] = {}
    for f in (1.0, 1.5, 2.15, 2.5, 2.72, 3.5, 6.0):
        monkeypatch.setenv(slowdown.ENV, str(f))
        seen[f] = slowdown.fleet_slots()
    assert seen == {1.0: 4, 1.5: 3, 2.15: 2, 2.5: 2, 2.72: 2, 3.5: 1, 6.0: 1}
