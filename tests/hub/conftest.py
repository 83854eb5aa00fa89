"""Helpers of the hub tests: configs over directory or S3 stores, tiny state dicts, training steps."""

from __future__ import annotations

import pathlib
from collections.abc import Callable
from typing import Any

import pytest
import torch
from hub_helpers import HUB_KEY, make_config

from fleetrl.config import FleetConfig


@pytest.fixture(autouse=True)
def _hub_key(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FLEETRL_HUB_KEY", HUB_KEY)
    torch.set_num_threads(1)


@pytest.fixture
def dir_config(tmp_path: pathlib.Path, run_id: str) -> Callable[..., FleetConfig]:
    def build(**kwargs: Any) -> FleetConfig:
        return make_config(run_id, {"home": (tmp_path / "home").as_uri()}, **kwargs)

    return build


