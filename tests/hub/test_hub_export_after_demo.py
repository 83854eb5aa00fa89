"""`fleetrl hub export` given the user's own config after `fleetrl demo` (no servers, directory stores).

A demo run signs with a key pair made for the run and keeps its stores under its work directory; the
run's own config (`<workdir>/fleet.yaml`) names both, the user's config neither. The export finds the
run under the default work directory and says which config it used; without one, its error names the
config to use.
"""

from __future__ import annotations

import pathlib

import pytest
import torch
import yaml

from fleetrl.cli import main
from fleetrl.config import load_config
from fleetrl.hub import Hub
from fleetrl.hub.signing import generate_ed25519

TINY = {"vocab_size": 64, "hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 1}


def _user_config(tmp_path: pathlib.Path) -> pathlib.Path:
    doc = {"run": "mine", "model": {"tiny": TINY}, "hub": {"home_store": "./stores/home"},
           "regions": [{"name": "r", "kafka": "127.0.0.1:9", "store": "./stores/r"}]}
    path = tmp_path / "fleet.yaml"
    path.write_text(yaml.safe_dump(doc))
    return path


def _demo_run(tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch) -> pathlib.Path:
    """What `fleetrl demo --config fleet.yaml` leaves: `.fleetrl/demo/fleet.yaml` naming its stores and
    the run's public key, and one version in its home store (signed with the run's private key)."""
    private, public = generate_ed25519()
    work = tmp_path / ".fleetrl" / "demo"
    doc = {"run": "mine", "model": {"tiny": TINY},
           "hub": {"home_store": str(work / "stores" / "home"), "signing": {"public_key": public}},
           "regions": [{"name": "r", "kafka": "127.0.0.1:9", "store": str(work / "stores" / "r")}]}
    work.mkdir(parents=True)
    (work / "fleet.yaml").write_text(yaml.safe_dump(doc))
    monkeypatch.setenv("FLEETRL_HUB_KEY", private)
    config = load_config(work / "fleet.yaml")
    with Hub.from_config(config) as hub:
        hub.publish({k: v.detach().to(torch.bfloat16) for k, v in config.model.build().state_dict().items()})
    monkeypatch.delenv("FLEETRL_HUB_KEY")  # the trainer alone held it
    return work / "fleet.yaml"


def test_the_users_own_config_exports_the_demo_run_and_says_which_config_it_used(
        tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    run_config = _demo_run(tmp_path, monkeypatch)
    code = main(["hub", "export", "--config", str(_user_config(tmp_path)), "--version", "latest",
                 "--out", str(tmp_path / "model")])
    err = capsys.readouterr().err
    assert code == 0, err
    assert f"--config {run_config}" in err
    assert (tmp_path / "model" / "config.json").is_file()


def test_without_a_demo_run_the_error_names_the_config_to_use(
        tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.delenv("FLEETRL_HUB_KEY", raising=False)
    code = main(["hub", "export", "--config", str(_user_config(tmp_path)), "--version", "latest",
                 "--out", str(tmp_path / "model")])
    err = capsys.readouterr().err
    assert code == 1 and err.count("\n") == 1, err
    assert "--config <workdir>/fleet.yaml" in err and "fleetrl demo" in err, err
    assert not (tmp_path / "model").exists()
