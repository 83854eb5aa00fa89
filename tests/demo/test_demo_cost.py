"""The demo summary's cost: the trainer's running totals from its last step, per 1,000 trained groups."""

from __future__ import annotations

import pytest

from fleetrl.demo.summary import _cost_line, cost_summary


def _row(step: int, usd_od: float, usd_spot: float, sampled: int, **extra: float) -> dict[str, float]:
    return {"step": step, "groups": 8, "tokens": 100, "cost_usd_total": usd_od + usd_spot,
            "cost_usd_on_demand": usd_od, "cost_usd_spot": usd_spot, "tokens_sampled_total": sampled, **extra}


def test_cost_per_1000_trained_groups_split_by_capacity() -> None:
    rows = [_row(1, 0.01, 0.004, 90), _row(2, 0.02, 0.008, 250, groups_resent_total=2, node_s_total=40.0,
                                          serving_s_total=30.0)]
    c = cost_summary(rows, trained=16)
    assert c["usd"] == pytest.approx(0.028) and c["trained_groups"] == 16
    assert c["usd_per_1000_groups"] == pytest.approx(1.75)  # 1000 x 0.028 / 16
    assert c["usd_per_1000_groups_by_capacity"] == pytest.approx({"on_demand": 1.25, "spot": 0.5})
    assert c["waste_share"] == pytest.approx(0.2)  # 200 of 250 sampled tokens trained
    assert c["paid_idle_share"] == pytest.approx(0.25) and c["groups_resent"] == 2
    line = _cost_line(c)
    assert "per 1,000 trained groups $1.750 (on-demand $1.2500, spot $0.5000)" in line
    assert "20.0% of the 250 tokens sampled never trained" in line


def test_an_unpriced_fleet_has_no_cost_and_steps_count_when_the_audit_has_none() -> None:
    assert cost_summary([{"step": 1, "groups": 8, "tokens": 10}]) == {}
    c = cost_summary([_row(1, 0.01, 0.0, 0)], trained=None)
    assert c["trained_groups"] == 8 and c["waste_share"] is None
    assert "no sampled tokens reported yet" in _cost_line(c)
