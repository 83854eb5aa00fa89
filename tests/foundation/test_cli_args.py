"""Bad command-line arguments are refused before any work starts: one line naming the argument, exit 2.

The types of fleetrl/cli_args.py refuse a value as argparse parses it (SystemExit 2); what only the
config can tell (a region or store it does not name, a combination of demo faults) is refused once it
is read (`main` returns 2). Either way no handler runs and nothing is written. (A version a store does
not hold: tests/hub/test_hub_cli_refusals.py.)
"""

from __future__ import annotations

import pathlib

import psutil
import pytest
import yaml

from fleetrl import cli
from fleetrl.cli import main

ROOT = pathlib.Path(__file__).resolve().parents[2]

# {tmp} is the test's tmp_path, which holds one file, `file`.
PARSED = [
    (["demo", "--steps", "-1"], "--steps", "must be >= 1, got -1"),
    (["demo", "--steps", "many"], "--steps", "whole number"),
    (["trainer", "--steps", "0"], "--steps", "must be >= 1, got 0"),
    (["demo", "--duration", "-5"], "--duration", "> 0 seconds"),
    (["demo", "--duration", "nan"], "--duration", "finite"),
    (["demo", "--kill-every", "0"], "--kill-every", "> 0 seconds"),
    (["demo", "--recover", "-1"], "--recover", "> 0 seconds"),
    (["demo", "--preempt-every", "-1"], "--preempt-every", "> 0 seconds"),
    (["demo", "--fuzz-rate", "1"], "--fuzz-rate", "[0, 1)"),
    (["demo", "--fuzz-records", "0"], "--fuzz-records", ">= 1"),
    (["demo", "--kill-only", "trainer,gpu"], "--kill-only", "'gpu'"),
    (["demo", "--crash-at", "no.such.point"], "--crash-at", "no crash point 'no.such.point'"),
    (["demo", "--crash-at", "hub.gc.object_deleted"], "--crash-at", "not reached by a demo process"),
    (["demo", "--partition", "local-b:20"], "--partition", "REGION:START:SECONDS"),
    (["demo", "--out", "{tmp}/file"], "--out", "is a file"),
    (["demo", "--workdir", "{tmp}/file"], "--workdir", "is a file"),
    (["topics", "dlq", "show", "--limit", "0"], "--limit", ">= 1"),
    (["topics", "dlq", "replay", "--region", "a", "--offset", "3"], "--offset", "PARTITION:OFFSET"),
    (["hub", "pull", "v3", "{tmp}/v3.safetensors"], "version", "'latest'"),
    (["hub", "pull", "latest", "{tmp}/no/v.safetensors"], "out", "does not exist"),
    (["hub", "pull", "latest", "{tmp}"], "out", "is a folder"),
    (["hub", "verify", "-1"], "version", "'-1'"),
    (["hub", "export", "--version", "-2", "--out", "{tmp}/model"], "--version", "'-2'"),
    (["hub", "export", "--version", "1", "--out", "{tmp}/file"], "--out", "already exists"),
    (["hub", "export", "--version", "1", "--out", "{tmp}/model", "--max-shard-size", "5 GB"], "--max-shard-size",
     "5GB"),
    (["hub", "publish", "{tmp}/missing"], "path", "no such file or folder"),
    (["status", "--wait-s", "-1"], "--wait-s", ">= 0 seconds"),
    (["status", "--watch", "0"], "--watch", "> 0 seconds"),
    (["config", "reference", "--update", "{tmp}/missing.md"], "--update", "no such file"),
    (["config", "check", "--log-level", "LOUD"], "--log-level", "DEBUG, INFO, WARNING, ERROR"),
]


@pytest.fixture
def no_handler(monkeypatch: pytest.MonkeyPatch) -> None:
    """Fail the test if any sub-command's handler is even imported."""

    def refuse(spec: str) -> cli.Handler:
        raise AssertionError(f"handler {spec} was loaded for a refused argument")

    monkeypatch.setattr(cli, "_load_handler", refuse)


@pytest.mark.parametrize(("argv", "argument", "says"), PARSED, ids=[" ".join(c[0]) for c in PARSED])
@pytest.mark.usefixtures("no_handler")
def test_a_bad_value_is_refused_as_it_is_parsed(argv: list[str], argument: str, says: str, tmp_path: pathlib.Path,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "file").write_text("x")
    with pytest.raises(SystemExit) as info:
        main([a.replace("{tmp}", str(tmp_path)) for a in argv])
    out, err = capsys.readouterr()
    assert info.value.code == 2
    assert out == "" and len(err.strip().splitlines()) == 1, err
    assert err.startswith(f"fleetrl {argv[0]}") and f": error: argument {argument}: " in err and says in err, err
    assert [p.name for p in tmp_path.iterdir()] == ["file"]  # nothing written


def test_the_line_is_the_one_the_issue_asks_for(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["demo", "--steps", "-1"])
    assert capsys.readouterr().err == "fleetrl demo: error: argument --steps: must be >= 1, got -1\n"


def test_valid_values_parse_as_before(tmp_path: pathlib.Path) -> None:
    parser = cli.build_parser()
    demo = parser.parse_args(["demo", "--steps", "3", "--duration", "2.5", "--kill-only", "trainer, agent",
                              "--crash-at", "trainer.checkpoint.renamed@2,hub.publish.manifest_written",
                              "--fuzz-rate", "0", "--log-level", "debug"])
    assert (demo.steps, demo.duration, demo.kill_only, demo.log_level) == (3, 2.5, ("trainer", "agent"), "DEBUG")
    assert demo.crash_at == [("trainer.checkpoint.renamed@2", "hub.publish.manifest_written")]
    export = parser.parse_args(["hub", "export", "--version", "latest", "--out", str(tmp_path / "m")])
    assert (export.hub_version, export.max_shard_size) == ("latest", "5GB")
    assert parser.parse_args(["hub", "pull", "12", str(tmp_path / "v.st")]).hub_version == 12
    assert parser.parse_args(["hub", "export", "--version", "0", "--out", "x", "--max-shard-size", "100kb"]
                             ).max_shard_size == "100KB"
    assert parser.parse_args(["topics", "dlq", "replay", "-r", "a", "--offset", "0:12"]).offsets == [(0, 12)]
    assert parser.parse_args(["status", "--wait-s", "0"]).wait_s == 0.0


@pytest.fixture
def fleet_file(tmp_path: pathlib.Path) -> pathlib.Path:
    doc = {"run": "t-args", "hub": {"home_store": str(tmp_path / "home")},
           "regions": [{"name": name, "kafka": "127.0.0.1:9", "store": str(tmp_path / name), "nodes": [{"name": "n1"}]}
                       for name in ("local-a", "local-b")]}
    path = tmp_path / "fleet.yaml"
    path.write_text(yaml.safe_dump(doc))
    return path


NAMED = [
    (["topics", "list", "--region", "eu"], "--region", "'eu' not in {config} (regions: local-a, local-b)"),
    (["topics", "dlq", "replay", "--region", "eu", "--all"], "--region", "(regions: local-a, local-b)"),
    (["control", "drain", "--region", "eu"], "--region", "(regions: local-a, local-b)"),
    (["agent", "--region", "eu", "--node", "n1"], "--region", "(regions: local-a, local-b)"),
    (["replicator", "--region", "eu"], "--region", "(regions: local-a, local-b)"),
    (["hub", "ls", "--store", "eu"], "--store", "'eu' not in {config} (stores: home, local-a, local-b)"),
    (["hub", "gc", "--store", "eu"], "--store", "(stores: home, local-a, local-b)"),
    (["hub", "verify", "--all", "--store", "home,eu"], "--store", "'eu' not in"),
    (["hub", "pull", "latest", "{tmp}/v.safetensors", "--store", "all"], "--store", "'all' not in"),
]


@pytest.mark.parametrize(("argv", "argument", "says"), NAMED, ids=[" ".join(c[0]) for c in NAMED])
@pytest.mark.usefixtures("no_handler")
def test_a_name_the_config_lacks_is_refused_once_it_is_read(
        argv: list[str], argument: str, says: str, fleet_file: pathlib.Path, tmp_path: pathlib.Path,
        capsys: pytest.CaptureFixture[str]) -> None:
    rc = main([*(a.replace("{tmp}", str(tmp_path)) for a in argv), "--config", str(fleet_file)])
    out, err = capsys.readouterr()
    assert rc == 2
    assert out == "" and len(err.strip().splitlines()) == 1, err
    assert f"error: argument {argument}: " in err and says.format(config=fleet_file) in err, err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["fleet.yaml"]  # no store, no output


EITHER = [
    (["hub", "verify"], "version", "give a version"),
    (["hub", "verify", "1", "--all"], "version", "one of them"),
    (["topics", "dlq", "replay", "--region", "local-a"], "--offset", "or --all"),
    (["topics", "dlq", "replay", "--region", "local-a", "--all", "--offset", "0:1"], "--offset", "one of them"),
]


@pytest.mark.parametrize(("argv", "argument", "says"), EITHER, ids=[" ".join(c[0]) for c in EITHER])
def test_one_of_two_arguments_is_asked_for_before_anything_is_reached(
        argv: list[str], argument: str, says: str, fleet_file: pathlib.Path, tmp_path: pathlib.Path,
        capsys: pytest.CaptureFixture[str]) -> None:
    rc = main([*argv, "--config", str(fleet_file)])
    out, err = capsys.readouterr()
    assert rc == 2
    assert out == "" and len(err.strip().splitlines()) == 1, err
    assert err.startswith(f"fleetrl {' '.join(argv[:2])}") and f": error: argument {argument}: " in err, err
    assert says in err and sorted(p.name for p in tmp_path.iterdir()) == ["fleet.yaml"]


DEMO = [
    (["--until-faults"], "--until-faults", "no fault to wait for"),
    (["--kill-only", "broker"], "--kill-only", "needs --durable"),
    (["--partition", "eu:5:5"], "--partition", "'eu' not in"),
]


@pytest.mark.parametrize(("extra", "argument", "says"), DEMO, ids=[" ".join(c[0]) for c in DEMO])
def test_demo_faults_that_do_not_fit_together_are_refused_before_anything_starts(
        extra: list[str], argument: str, says: str, tmp_path: pathlib.Path,
        capsys: pytest.CaptureFixture[str]) -> None:
    children = {p.pid for p in psutil.Process().children(recursive=True)}
    config = ROOT / "examples" / "fleet.demo.yaml"
    rc = main(["demo", "--config", str(config), "--workdir", str(tmp_path / "work"), *extra])
    err = capsys.readouterr().err
    assert rc == 2 and len(err.strip().splitlines()) == 1, err
    assert err.startswith("fleetrl demo: error: ") and f"argument {argument}: " in err and says in err, err
    assert not (tmp_path / "work").exists()
    assert {p.pid for p in psutil.Process().children(recursive=True)} <= children  # no server started
