"""Fixtures of the broker tests: a fleet config pointing at the fixture servers."""

from __future__ import annotations

import pytest
from broker_testkit import fleet_yaml, make_config

from fleetrl.broker import RecordLimits
from fleetrl.config import FleetConfig


@pytest.fixture
def fleet_config(run_id: str, tansu_bootstrap: str) -> FleetConfig:
    return make_config(fleet_yaml(run_id, tansu_bootstrap))


@pytest.fixture
def limits(fleet_config: FleetConfig) -> RecordLimits:
    return RecordLimits.from_config(fleet_config)
