"""`fleetrl eval` on a directory hub: a version's table, and the same figures from its exported folder."""

from __future__ import annotations

import json
import pathlib

import pytest
import torch
import yaml
from fleet_testkit import publish_tiny

from fleetrl.cli import main
from fleetrl.config import load_config

HUB_KEY = "6680e5459cd0040518f9d6b4ec6f916984f5a12f538b6eea69e195dc1a06cc09"  # Ed25519 private key (hex)


@pytest.fixture(autouse=True)
def _env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FLEETRL_HUB_KEY", HUB_KEY)
    torch.set_num_threads(1)


def _config(tmp_path: pathlib.Path) -> pathlib.Path:
    store = (tmp_path / "store").as_uri()
    doc = {"run": "evcli", "model": {"tiny": {"vocab_size": 128, "hidden_size": 32, "intermediate_size": 64,
                                              "num_hidden_layers": 1}},
           "algorithm": {"max_new_tokens": 6},
           "hub": {"home_store": store},
           "eval": {"sets": [{"name": "held", "num_prompts": 6, "samples_per_prompt": 3, "temperature": 1.0,
                              "pass_threshold": 0.3},
                             {"name": "greedy", "num_prompts": 4}],
                    "before_training": True},
           "regions": [{"name": "r1", "kafka": "127.0.0.1:1", "store": store}]}
    path = tmp_path / "fleet.yaml"
    path.write_text(yaml.safe_dump(doc))
    return path


def _rows(capsys: pytest.CaptureFixture[str], *args: str) -> list[dict[str, object]]:
    assert main(["eval", *args, "--where", "local", "--json"]) == 0  # no fleet to look for (test_eval_fleet.py)
    rows: list[dict[str, object]] = json.loads(capsys.readouterr().out)
    return rows


def test_eval_of_a_version_and_of_its_exported_folder_agree(tmp_path: pathlib.Path,
                                                            capsys: pytest.CaptureFixture[str]) -> None:
    path = _config(tmp_path)
    assert publish_tiny(load_config(path)) == 0
    rows = _rows(capsys, "--config", str(path), "--version", "latest")
    assert [(r["set"], r["version"], r["prompts"], r["samples"], r["k"]) for r in rows] == [
        ("held", 0, 6, 18, 3), ("greedy", 0, 4, 4, 1)]
    for r in rows:
        assert 0.0 <= r["pass@1"] <= r[f"pass@{r['k']}"] <= 1.0 and 1 <= r["length_mean"] <= 6  # type: ignore[operator]
    assert _rows(capsys, "--config", str(path), "--version", "0", "--set", "greedy") == rows[1:]
    assert main(["hub", "export", "--config", str(path), "--version", "0", "--out", str(tmp_path / "v0")]) == 0
    capsys.readouterr()
    # The same weights from a folder: the same samples (counter-based sampling, same group ids), the same figures.
    assert _rows(capsys, "--config", str(path), "--model", str(tmp_path / "v0")) == rows


def test_eval_refuses_an_unknown_set_naming_the_field(tmp_path: pathlib.Path,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    path = _config(tmp_path)
    publish_tiny(load_config(path))
    assert main(["eval", "--config", str(path), "--version", "0", "--set", "nope", "--where", "local"]) != 0
    err = capsys.readouterr().err
    assert "eval.sets" in err and "nope" in err
    # a version the store does not hold: a bad argument, named
    assert main(["eval", "--config", str(path), "--version", "7", "--where", "local"]) == 2
    assert "argument --version" in capsys.readouterr().err
