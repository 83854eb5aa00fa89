"""Fixtures of the trainer tests: a fleet config over the real servers of tests/conftest.py."""

from __future__ import annotations

import pathlib
from collections.abc import Callable
from typing import Any

import pytest
import torch
from trainer_groups import HUB_KEY

from fleetrl.config import FleetConfig


@pytest.fixture(autouse=True)
def _trainer_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FLEETRL_HUB_KEY", HUB_KEY)
    torch.set_num_threads(1)


def fleet_dict(run: str, bootstrap: str, mqtt_port: int, tmp: pathlib.Path, **algorithm: Any) -> dict[str, Any]:
    return {
        "run": run,
        "model": {"tiny": {"vocab_size": 128, "hidden_size": 64, "intermediate_size": 128,
                           "num_hidden_layers": 2}},
        "algorithm": {"groups_per_step": 2, "n_samples": 2, "max_staleness": 1, "max_new_tokens": 8,
                      "lr": 1e-3, **algorithm},
        "dataset": {"task": "reverse"},
        "hub": {"home_store": str(tmp / "home")},
        "mqtt": {"url": f"mqtt://127.0.0.1:{mqtt_port}"},
        "kafka": {"partitions": {"prompts": 2, "partials": 1, "trajectories": 2, "dead_letter": 1}},
        "trainer": {"checkpoint_dir": str(tmp / "ckpt")},
        "regions": [{"name": "local-a", "kafka": bootstrap, "store": str(tmp / "store-a"),
                     "nodes": [{"name": "node-1"}]}],
    }


@pytest.fixture
def make_fleet(run_id: str, tansu_bootstrap: str, mqtt_server: Any, tmp_path: pathlib.Path
               ) -> Callable[..., FleetConfig]:
    def make(**algorithm: Any) -> FleetConfig:
        return FleetConfig.model_validate(fleet_dict(run_id, tansu_bootstrap, mqtt_server.port, tmp_path,
                                                     **algorithm))

    return make
