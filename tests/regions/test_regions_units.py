"""The systemd units shipped in the package: their directives, the drain bound, `fleetrl units install`.

(systemd's own checks of them, `verify` and `security`: test_regions_units_sandbox.py.)"""

from __future__ import annotations

import configparser
import pathlib
import subprocess
import sys
from importlib import resources

import pytest
from slowdown import scaled

from fleetrl.config.models import RolloutConfig, TrainerConfig
from fleetrl.regions.units import UNIT_NAMES, unit_text

COMMON = {
    "Restart": "on-failure", "User": "fleetrl", "Group": "fleetrl", "NoNewPrivileges": "yes",
    "ProtectSystem": "strict", "ReadWritePaths": "/var/lib/fleetrl", "StateDirectory": "fleetrl",
    "PrivateTmp": "yes", "ProtectHome": "yes", "KillMode": "mixed", "KillSignal": "SIGTERM",
    "StandardOutput": "journal", "StandardError": "journal", "LoadCredential": "fleetrl:/etc/fleetrl/credentials",
}


def _parse(text: str) -> configparser.RawConfigParser:
    # systemd repeats keys (EnvironmentFile=, Environment=): keep the last, as strict=False does.
    parser = configparser.RawConfigParser(strict=False, interpolation=None, delimiters=("=",))
    parser.optionxform = str  # type: ignore[assignment,method-assign]  # directives are case-sensitive
    parser.read_string(text)
    return parser


def _seconds(value: str) -> float:
    return float(value.removesuffix("s"))


@pytest.mark.parametrize("name", UNIT_NAMES)
def test_unit_holds_every_required_directive(name: str) -> None:
    unit = _parse(unit_text(name))
    service = dict(unit["Service"])
    assert {k: service.get(k) for k in COMMON} == COMMON
    assert _seconds(service["RestartSec"]) > 0
    assert service["ExecStart"].startswith("/opt/fleetrl/venv/bin/fleetrl ")
    assert service["ExecStart"].endswith(" --log-json")
    assert " --config /etc/fleetrl/fleet.yaml " in service["ExecStart"]
    assert unit["Install"]["WantedBy"] == "multi-user.target"
    assert "network-online.target" in unit["Unit"]["After"]


def test_agent_unit_identity_and_stop_timeout_above_the_drain_bound() -> None:
    text = unit_text("fleetrl-agent.service")
    service = _parse(text)["Service"]
    assert service["ExecStart"] == ("/opt/fleetrl/venv/bin/fleetrl agent --config /etc/fleetrl/fleet.yaml "
                                    "--region ${FLEETRL_REGION} --node ${FLEETRL_NODE} --log-json")
    assert "EnvironmentFile=/etc/fleetrl/node.env\n" in text  # required: no identity, no agent
    # The agent's bound: workers get 1.5 x handover_timeout_s + 5 s, then 5 s to exit, 2 s for the
    # last heartbeat (regions/agent.py); systemd must not SIGKILL before that.
    drain_bound_s = 1.5 * RolloutConfig().handover_timeout_s + 5 + 5 + 2
    assert _seconds(service["TimeoutStopSec"]) >= max(60.0, drain_bound_s)


def test_trainer_creates_the_topics_then_trains() -> None:
    text = unit_text("fleetrl-trainer.service", venv="/srv/venv", config="/srv/fleet.yaml")
    service = _parse(text)["Service"]
    assert service["ExecStart"] == "/srv/venv/bin/fleetrl trainer --config /srv/fleet.yaml --log-json"
    assert "ExecStartPre=/srv/venv/bin/fleetrl topics create --config /srv/fleet.yaml --log-json\n" in text
    # The trainer finishes its step, then checkpoints within trainer.drain_timeout_s.
    assert _seconds(service["TimeoutStopSec"]) >= 2 * TrainerConfig().drain_timeout_s


def test_replicator_template_takes_the_region_from_its_instance() -> None:
    service = _parse(unit_text("fleetrl-replicator@.service"))["Service"]
    assert service["ExecStart"] == ("/opt/fleetrl/venv/bin/fleetrl replicator --config /etc/fleetrl/fleet.yaml "
                                    "--region %i --log-json")


def test_cli_install_writes_every_unit(tmp_path: pathlib.Path) -> None:
    done = subprocess.run([sys.executable, "-m", "fleetrl.cli", "units", "install", "--dest", str(tmp_path),
                           "--prefix", "/srv/fleetrl/venv", "--config", "/srv/fleetrl/fleet.yaml"],
                          capture_output=True, text=True, timeout=scaled(60), check=False)
    assert done.returncode == 0, done.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(UNIT_NAMES)  # no temp files left
    assert done.stdout.split() == [str(tmp_path / n) for n in UNIT_NAMES]
    agent = (tmp_path / "fleetrl-agent.service").read_text()
    assert "ExecStart=/srv/fleetrl/venv/bin/fleetrl agent --config /srv/fleetrl/fleet.yaml " in agent
    assert (tmp_path / "fleetrl-agent.service").stat().st_mode & 0o777 == 0o644


def test_cli_prints_the_units_without_dest_and_refuses_bad_paths(tmp_path: pathlib.Path) -> None:
    done = subprocess.run([sys.executable, "-m", "fleetrl.cli", "units", "install"],
                          capture_output=True, text=True, timeout=scaled(60), check=False)
    assert done.returncode == 0 and done.stdout.count("[Service]") == len(UNIT_NAMES)
    for bad in (["--prefix", "relative/venv"], ["--prefix", "/opt/my venv"], ["--dest", str(tmp_path / "no")]):
        done = subprocess.run([sys.executable, "-m", "fleetrl.cli", "units", "install", *bad],
                              capture_output=True, text=True, timeout=scaled(60), check=False)
        assert done.returncode == 2 and done.stderr.startswith("fleetrl units: "), done.stderr
    assert list(tmp_path.iterdir()) == []


def test_the_package_ships_the_units() -> None:
    folder = resources.files("fleetrl.regions").joinpath("systemd")
    assert sorted(p.name for p in folder.iterdir() if p.name.endswith(".service")) == sorted(UNIT_NAMES)
    with pytest.raises(ValueError, match="no packaged unit"):
        unit_text("fleetrl-rollout.service")


# Directives that run the daemon rather than confine it; every other one is a sandbox directive.
_OPERATIONAL = {"Type", "User", "Group", "EnvironmentFile", "Environment", "LoadCredential", "WorkingDirectory",
                "ExecStart", "ExecStartPre", "StandardOutput", "StandardError", "SyslogIdentifier", "KillMode",
                "KillSignal", "TimeoutStopSec", "Restart", "RestartSec"}


def test_docs_name_every_sandbox_directive() -> None:
    docs = pathlib.Path(__file__).resolve().parents[2] / "docs"
    directives = {key for name in UNIT_NAMES for key in _parse(unit_text(name))["Service"]} - _OPERATIONAL
    for page in ("security.md", "regions.md"):
        text = (docs / page).read_text(encoding="utf-8")
        assert [d for d in sorted(directives) if f"`{d}=" not in text] == [], page
