"""`fleetrl demo`'s checks before it starts anything, and its reading of log events (no servers)."""

from __future__ import annotations

import json
import pathlib
import socket

import pytest
import yaml

from fleetrl.cli import main
from fleetrl.config import load_config
from fleetrl.demo.procs import MARKER, DemoError, effective_config, fresh_workdir, loopback_ports
from fleetrl.demo.view import LogTail, Progress, RegionView

ROOT = pathlib.Path(__file__).resolve().parents[2]


def _config(tmp_path: pathlib.Path, **changes: object) -> pathlib.Path:
    doc = yaml.safe_load((ROOT / "examples" / "fleet.demo.yaml").read_text())
    doc.update(changes)
    path = tmp_path / "fleet.yaml"
    path.write_text(yaml.safe_dump(doc))
    return path


def test_a_taken_port_fails_with_one_line_naming_it(tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str]) -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        port = sock.getsockname()[1]
        path = _config(tmp_path, mqtt={"url": f"mqtt://127.0.0.1:{port}"})
        rc = main(["demo", "--config", str(path), "--workdir", str(tmp_path / "work")])
    err = capsys.readouterr().err.strip()
    assert rc == 1 and len(err.splitlines()) == 1
    assert f"port {port} (MQTT" in err and "already in use" in err
    assert not (tmp_path / "work").exists()  # refused before touching anything


def test_brokers_must_be_on_loopback(tmp_path: pathlib.Path) -> None:
    doc = yaml.safe_load((ROOT / "examples" / "fleet.demo.yaml").read_text())
    doc["regions"][1]["kafka"] = "kafka.example.com:9092"
    path = tmp_path / "fleet.yaml"
    path.write_text(yaml.safe_dump(doc))
    with pytest.raises(DemoError, match=r"regions\[1\]\.kafka must be one 127\.0\.0\.1:PORT"):
        loopback_ports(load_config(path), str(path))


def test_workdir_is_wiped_only_when_it_is_the_demos(tmp_path: pathlib.Path) -> None:
    default = tmp_path / "default"
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "thesis.tex").write_text("precious")
    with pytest.raises(DemoError, match="refusing to wipe"):
        fresh_workdir(mine, default)
    assert (mine / "thesis.tex").exists()
    work = fresh_workdir(tmp_path / "work", default)
    (work / "stores").mkdir()
    (work / "stores" / "old").write_text("a previous run")
    again = fresh_workdir(work, default)
    assert sorted(p.name for p in again.iterdir()) == sorted([MARKER, "logs"])


def test_effective_config_puts_every_store_and_checkpoint_in_the_workdir(tmp_path: pathlib.Path) -> None:
    config = load_config(ROOT / "examples" / "fleet.demo.yaml")
    eff = effective_config(config, tmp_path)
    assert eff.hub.home_store.url == str(tmp_path / "stores" / "home")
    assert [r.store.url for r in eff.regions] == [str(tmp_path / "stores" / r.name) for r in eff.regions]
    assert eff.trainer.checkpoint_dir == str(tmp_path / "checkpoints")
    assert config.hub.home_store.url != eff.hub.home_store.url  # the loaded config is left alone


def test_log_tail_yields_complete_json_lines_once(tmp_path: pathlib.Path) -> None:
    path = tmp_path / "x.log"
    tail = LogTail(path)
    assert list(tail.events()) == []  # not there yet
    with open(path, "w") as f:
        f.write('tansu broker 0.6.0\n'
                '{"event": "step.done", "step": 1, "version": 1, "reward_mean": 0.1}\n{"event": "ha')
    assert [e["step"] for e in tail.events()] == [1]
    with open(path, "a") as f:
        f.write('lf"}\n')
    assert [e["event"] for e in tail.events()] == ["half"]
    assert list(tail.events()) == []


def test_progress_folds_trainer_replicator_and_agent_events() -> None:
    p = Progress(3, {"a": RegionView(), "b": RegionView()})
    events = [
        ({"event": "weights.published", "version": 0, "anchor": 0, "bytes": 1000}, None),
        ({"event": "replicator.copied", "version": 0, "region": "a", "source": "home", "bytes": 1000}, None),
        ({"event": "agent.state", "state": "draining"}, ("b", "n1")),
        ({"event": "worker.group_done", "group_id": "g"}, ("a", "n1")),
        ({"event": "step.done", "step": 1, "version": 1, "reward_mean": 0.25}, None),
    ]
    lines = [p.feed(json.loads(json.dumps(e)), agent) for e, agent in events]
    assert lines[:4] == [None] * 4 and lines[4] is not None and "step 1/3" in lines[4]
    assert (p.step, p.version, p.rewards) == (1, 1, [0.25])
    assert p.regions["a"].replica_version == 0 and p.regions["a"].sources == {"home": 1}
    assert p.regions["a"].groups_done == 1 and p.regions["b"].nodes == {"n1": "draining"}
    assert p.holding_latest() == []  # version 1 is not replicated yet


def test_a_restarted_trainer_takes_the_view_back_to_its_checkpoint() -> None:
    """A trainer SIGKILLed after a step it had not checkpointed restarts from the checkpoint: the view
    (and so the summary's `steps` and metrics.jsonl, which the chaos tests hold against the books)
    shows the steps the model has, not the highest one a killed trainer logged."""
    p = Progress(10, {"a": RegionView()})
    for step in (1, 2, 3):
        p.feed({"event": "step.done", "step": step, "version": step, "reward_mean": step / 10})
    p.feed({"event": "trainer.started", "resumed": True, "step": 2, "version": 4})
    assert (p.step, p.rewards, sorted(p.steps)) == (2, [0.1, 0.2], [1, 2])
    p.feed({"event": "step.done", "step": 3, "version": 5, "reward_mean": 0.5})
    assert (p.step, p.rewards, sorted(p.steps)) == (3, [0.1, 0.2, 0.5], [1, 2, 3])
    p.feed({"event": "trainer.started", "resumed": False, "version": 0})  # killed before its first checkpoint
    assert (p.step, p.rewards, p.steps) == (0, [], {})
