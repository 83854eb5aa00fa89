"""`fleetrl hub export | pull | verify` refuse a version the store does not hold: one line naming the
argument and the store's newest version, exit 2, nothing written (a directory store, in process)."""

from __future__ import annotations

import pathlib

import pytest
import yaml
from hub_helpers import tiny_state

from fleetrl.cli import main
from fleetrl.config import load_config
from fleetrl.hub import Hub


@pytest.fixture
def config_file(tmp_path: pathlib.Path, run_id: str) -> pathlib.Path:
    """Versions 0 and 1 in the home store; the region store `west` holds none."""
    doc = {"run": run_id, "hub": {"home_store": str(tmp_path / "home"), "threads": 1},
           "regions": [{"name": "west", "kafka": "127.0.0.1:9", "store": str(tmp_path / "west")}]}
    path = tmp_path / "fleet.yaml"
    path.write_text(yaml.safe_dump(doc))
    (tmp_path / "west").mkdir()  # opening a directory store makes its folder
    with Hub.from_config(load_config(path)) as hub:
        hub.publish(tiny_state(0))
        hub.publish(tiny_state(1))
    return path


REFUSED = [
    (["hub", "export", "--version", "999", "--out", "{tmp}/model"], "--version",
     "999 not in store 'home' (newest is 1)"),
    (["hub", "pull", "7", "{tmp}/v7.safetensors"], "version", "7 not in store 'home' (newest is 1)"),
    (["hub", "verify", "5"], "version", "5 not in store 'home' (newest is 1)"),
    (["hub", "pull", "0", "{tmp}/v0.safetensors", "--store", "west"], "version",
     "0 not in store 'west' (it holds no version of run"),
]


@pytest.mark.parametrize(("argv", "argument", "says"), REFUSED, ids=[" ".join(c[0][:3]) for c in REFUSED])
def test_a_version_the_store_lacks_is_refused_naming_the_newest(
        argv: list[str], argument: str, says: str, config_file: pathlib.Path, tmp_path: pathlib.Path,
        capsys: pytest.CaptureFixture[str]) -> None:
    before = sorted(tmp_path.rglob("*"))
    rc = main([*(a.replace("{tmp}", str(tmp_path)) for a in argv), "--config", str(config_file)])
    out, err = capsys.readouterr()
    assert rc == 2
    assert out == "" and len(err.strip().splitlines()) == 1, err
    assert err.startswith(f"fleetrl {argv[0]} {argv[1]}: error: argument {argument}: {says}"), err
    assert sorted(tmp_path.rglob("*")) == before  # no export folder, no pulled file
