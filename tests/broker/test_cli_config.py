"""A bad fleet.yaml stops every command with one line naming the field and the file, exit code 2."""

from __future__ import annotations

import contextlib
import io
import pathlib

import pytest
import yaml
from broker_testkit import fleet_yaml

from fleetrl.cli import main


def _broken(tmp_path: pathlib.Path, mutate: str) -> pathlib.Path:
    data = fleet_yaml("bad-run", "127.0.0.1:9092")
    if mutate == "wrong_type":
        data["kafka"]["partitions"]["prompts"] = "many"
    elif mutate == "unknown_region":
        data["regions"][0]["link_costs"] = {"home": 1, "atlantis": 2}
    elif mutate == "missing_bootstrap":
        del data["regions"][0]["kafka"]
    path = tmp_path / f"{mutate}.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


@pytest.mark.parametrize(("mutate", "field"), [
    ("wrong_type", "kafka.partitions.prompts"),
    ("unknown_region", "link_costs"),
    ("missing_bootstrap", "kafka"),
])
@pytest.mark.parametrize("command", [["topics", "create"], ["topics", "lag"], ["status"]])
def test_bad_config_exits_with_one_line_naming_field_and_file(
    tmp_path: pathlib.Path, mutate: str, field: str, command: list[str]
) -> None:
    path = _broken(tmp_path, mutate)
    stderr = io.StringIO()
    with contextlib.redirect_stderr(stderr):  # not capsys: see test_cli_topics.Run
        assert main([*command, "--config", str(path)]) == 2
    err = stderr.getvalue().strip()
    assert "\n" not in err
    assert str(path) in err and field in err
    if mutate == "unknown_region":
        assert "atlantis" in err
