"""`fleetrl hub publish | pull | verify | ls | gc` and `fleetrl replicator --once`, in process."""

from __future__ import annotations

import json
import pathlib

import pytest
import yaml
from hub_helpers import same_bits, step, tiny_state
from safetensors.torch import load_file, save_file

from fleetrl.cli import main


@pytest.fixture
def config_file(tmp_path: pathlib.Path, run_id: str) -> pathlib.Path:
    doc = {
        "run": run_id,
        "hub": {"home_store": str(tmp_path / "home"), "anchor_interval": 4, "retention_versions": 1,
                "gc_grace_s": 0, "threads": 1},
        "regions": [{"name": "west", "kafka": "127.0.0.1:9", "store": str(tmp_path / "west"),
                     "link_costs": {"home": 1}}],
    }
    path = tmp_path / "fleet.yaml"
    path.write_text(yaml.safe_dump(doc))
    return path


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str]:
    code = main(list(argv))
    return code, capsys.readouterr().out


def test_publish_pull_verify_ls_gc_and_replicate_once(
        config_file: pathlib.Path, tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str]) -> None:
    cfg = ["--config", str(config_file)]
    states = [tiny_state()]
    for i in range(1, 5):
        states.append(step(states[-1], i))
    for i, state in enumerate(states):
        folder = tmp_path / f"ckpt{i}"
        folder.mkdir()
        save_file({k: v for k, v in state.items() if k != "lm_head.weight"}, str(folder / "model.safetensors"))
        code, out = run(capsys, "hub", "publish", str(folder), *cfg)
        published = json.loads(out)
        assert code == 0 and published["version"] == i
        # Each `hub publish` is a fresh publisher: it reads version i-1 back from the store and deltas
        # against it; anchors come only with the first version and every anchor_interval (4) versions.
        assert published["anchor"] == (0 if i < 4 else 4)
        assert (published["anchor_reason"] is None) == (0 < i < 4), published

    code, out = run(capsys, "replicator", "--region", "west", "--once", *cfg)
    assert code == 0, capsys.readouterr().err
    code, out = run(capsys, "hub", "pull", "latest", str(tmp_path / "v4.safetensors"), "--store", "west", *cfg)
    assert code == 0, capsys.readouterr().err
    pulled = load_file(str(tmp_path / "v4.safetensors"))
    pulled["lm_head.weight"] = pulled["model.embed_tokens.weight"]
    assert same_bits(pulled, states[4])

    code, out = run(capsys, "hub", "verify", "1", *cfg)
    assert code == 0 and json.loads(out)["ok"]
    code, out = run(capsys, "hub", "ls", "--json", *cfg)
    rows = json.loads(out)
    assert [r["version"] for r in rows] == [0, 1, 2, 3, 4] and rows[4]["latest"] and "west" in rows[4]["holders"]
    assert rows[1]["encodings"].get("anchor", 0) == 0

    # Version 4 is an anchor, so with a window of one version, versions 0..3 may go.
    code, out = run(capsys, "hub", "gc", "--dry-run", *cfg)
    assert json.loads(out)["deleted_versions"] == [0, 1, 2, 3] and code == 0
    code, out = run(capsys, "hub", "gc", *cfg)
    assert code == 0 and json.loads(out)["deleted_objects"] >= 1
    code, out = run(capsys, "hub", "ls", "--json", *cfg)
    assert [r["version"] for r in json.loads(out)] == [4]

    for obj in (tmp_path / "home").rglob("objects/*"):
        obj.write_bytes(obj.read_bytes()[:-3])
    assert main(["hub", "verify", "4", *cfg]) == 1
    assert "IntegrityError" in capsys.readouterr().err
    assert main(["hub", "pull", "7", str(tmp_path / "x.safetensors"), *cfg]) == 2  # a bad argument (issue 47)
    assert "argument version: 7 not in store 'home' (newest is 4)" in capsys.readouterr().err
