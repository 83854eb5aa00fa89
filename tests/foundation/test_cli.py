"""The `fleetrl` entry point: instant help, version, one-line errors."""

from __future__ import annotations

import pathlib
import subprocess
import sys

import pytest
from slowdown import scaled

from fleetrl.cli import build_parser, main

COMMANDS = [
    ["demo"], ["config", "check"], ["config", "reference"], ["topics", "create"], ["topics", "list"],
    ["topics", "describe"], ["topics", "lag"], ["topics", "dlq", "show"], ["topics", "dlq", "replay"],
    ["hub", "publish"], ["hub", "pull"], ["hub", "verify"], ["hub", "ls"], ["hub", "export"], ["hub", "gc"],
    ["trainer"], ["agent"], ["replicator"], ["status"], ["audit"], ["eval"], ["control", "drain"],
    ["control", "resume"], ["control", "stop"], ["units", "install"],
]


def test_help_imports_nothing_heavy() -> None:
    code = (
        "import sys, contextlib, io\n"
        "from fleetrl.cli import main\n"
        "with contextlib.redirect_stdout(io.StringIO()):\n"
        "    try: main(['--help'])\n"
        "    except SystemExit: pass\n"
        "heavy = [m for m in ('torch', 'transformers', 'aiokafka', 'boto3', 'numpy') if m in sys.modules]\n"
        "print(','.join(heavy))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=scaled(60), check=True)
    assert out.stdout.strip() == ""


@pytest.mark.parametrize("command", COMMANDS, ids=" ".join)
def test_every_design_command_has_help(command: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main([*command, "--help"])
    assert info.value.code == 0
    assert "usage: fleetrl" in capsys.readouterr().out


def test_every_handler_names_an_importable_module() -> None:
    import importlib.util

    parser = build_parser()
    handlers: list[str] = []

    def walk(p: object) -> None:
        for action in getattr(p, "_actions", []):
            for sub in (getattr(action, "choices", None) or {}).values():
                if hasattr(sub, "_defaults") and "handler" in sub._defaults:
                    handlers.append(sub._defaults["handler"])
                walk(sub)

    walk(parser)
    assert len(handlers) == len(COMMANDS)
    missing = [h for h in handlers if importlib.util.find_spec(h.split(":")[0]) is None]
    assert missing == [], f"handlers whose module does not exist: {missing}"


def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--version"]) == 0
    assert capsys.readouterr().out.startswith("fleetrl ")


def test_config_check_prints_resolved_config(capsys: pytest.CaptureFixture[str]) -> None:
    root = pathlib.Path(__file__).resolve().parents[2]
    assert main(["config", "check", str(root / "examples" / "fleet.demo.yaml")]) == 0
    out = capsys.readouterr().out
    assert "run: demo" in out and "# ok: run 'demo', 2 region(s)" in out


def test_bad_config_exits_2_with_one_line(tmp_path: pathlib.Path) -> None:
    bad = tmp_path / "fleet.yaml"
    bad.write_text("run: r\nregions:\n  - name: a\n    kafka: h:1\n    store: ./s\n    link_costs: {nowhere: 1}\n")
    proc = subprocess.run([sys.executable, "-m", "fleetrl.cli", "config", "check", str(bad)],
                          capture_output=True, text=True, timeout=scaled(60))
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1
    assert str(bad) in lines[0] and "regions[a].link_costs" in lines[0] and ":6:" in lines[0]
