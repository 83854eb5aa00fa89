"""The MQTT control plane over TLS with a user name and password, against a real broker (amqtt's TLS
listener and password file; the test CA is made at run time).

Heartbeats, the retained policy and a killed node's last will all cross the TLS connection; a wrong
password and an untrusted certificate each end in one clear line instead of a reconnect loop.
"""

from __future__ import annotations

import asyncio
import os
import pathlib
import signal
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import pytest
from broker_testkit import fleet_yaml, make_config, wait_for, write_config
from slowdown import scaled
from tls_testkit import Pki, make_pki

from fleetrl import devstack
from fleetrl.broker import ControlPlane, ControlPlaneError, PolicyAnnouncement
from fleetrl.config import FleetConfig

pytestmark = pytest.mark.integration
HERE = pathlib.Path(__file__).parent
USER, PASSWORD = "fleetrl", "mqtt-test-password-7f3a"


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    return make_pki(tmp_path_factory.mktemp("mqtt-pki"))


@pytest.fixture(scope="module")
def mqtts_server(pki: Pki, tmp_path_factory: pytest.TempPathFactory) -> Iterator[devstack.ServerProcess]:
    with devstack.mqtt_broker(workdir=tmp_path_factory.mktemp("amqtt"), users={USER: PASSWORD},
                              tls=(pki.cert_file, pki.key_file)) as server:
        yield server


def _yaml(run_id: str, port: int, ca_file: pathlib.Path, password_file: pathlib.Path) -> dict[str, Any]:
    data = fleet_yaml(run_id, "127.0.0.1:9")
    data["mqtt"] = {"url": f"mqtts://127.0.0.1:{port}", "username": USER, "password_file": str(password_file),
                    "ca_file": str(ca_file), "reconnect_max_s": 1.0}
    return data


def _config(run_id: str, server: devstack.ServerProcess, pki: Pki, tmp_path: pathlib.Path,
            password: str = PASSWORD, ca_file: pathlib.Path | None = None) -> FleetConfig:
    (tmp_path / "mqtt-password").write_text(password + "\n")
    return make_config(_yaml(run_id, server.port, ca_file or pki.ca_file, tmp_path / "mqtt-password"))


async def test_heartbeats_last_will_and_retained_policy_cross_tls_with_auth(
        run_id: str, mqtts_server: devstack.ServerProcess, pki: Pki, tmp_path: pathlib.Path) -> None:
    config = _config(run_id, mqtts_server, pki, tmp_path)
    path = write_config(_yaml(run_id, mqtts_server.port, pki.ca_file, tmp_path / "mqtt-password"),
                        tmp_path / "fleet.yaml")
    policy = PolicyAnnouncement(version=5, manifest="r/versions/000000000005.json", anchor=0, sha256="cd" * 32,
                                published_at=1.0)
    async with ControlPlane(config, f"{run_id}-trainer", connect_timeout_s=scaled(30)) as trainer:
        await trainer.announce_policy(policy)
        with subprocess.Popen([sys.executable, str(HERE / "mqtt_node.py"), str(path), "r1", "n7"],
                              stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True) as node:
            try:
                line = await asyncio.wait_for(asyncio.to_thread(node.stdout.readline), scaled(30))  # type: ignore[union-attr]
                assert line.strip() == "ready"
                assert await wait_for(lambda: ("r1", "n7") in trainer.nodes, 10)
                assert trainer.nodes[("r1", "n7")].state == "up"
            finally:
                os.kill(node.pid, signal.SIGKILL)
                node.wait(timeout=scaled(10))
        assert await wait_for(lambda: trainer.nodes[("r1", "n7")].state == "offline", 10)  # the last will
    async with ControlPlane(config, f"{run_id}-late", connect_timeout_s=scaled(30)) as late:  # retained state, over TLS
        assert await late.wait_for_policy(5, timeout_s=scaled(10)) == policy
        assert await wait_for(lambda: ("r1", "n7") in late.nodes, 10)
        assert late.nodes[("r1", "n7")].state == "offline"


async def test_a_wrong_password_is_one_clear_line(
        run_id: str, mqtts_server: devstack.ServerProcess, pki: Pki, tmp_path: pathlib.Path) -> None:
    config = _config(run_id, mqtts_server, pki, tmp_path, password="wrong-password-x1")
    client = ControlPlane(config, f"{run_id}-intruder", connect_timeout_s=scaled(20))
    with pytest.raises(ControlPlaneError) as info:
        await client.__aenter__()
    message = str(info.value)
    assert "\n" not in message and f"refused user {USER!r}" in message and str(mqtts_server.port) in message
    assert "wrong-password-x1" not in message
    assert client.connections == 0


def test_a_wrong_password_ends_status_with_one_line(
        run_id: str, mqtts_server: devstack.ServerProcess, pki: Pki, tmp_path: pathlib.Path) -> None:
    (tmp_path / "mqtt-password").write_text("wrong-password-x2\n")
    path = write_config(_yaml(run_id, mqtts_server.port, pki.ca_file, tmp_path / "mqtt-password"),
                        tmp_path / "fleet.yaml")
    out = subprocess.run([sys.executable, "-m", "fleetrl.cli", "status", "--config", str(path)],
                         capture_output=True, text=True, timeout=scaled(60))
    lines = [line for line in out.stderr.splitlines() if line.startswith("fleetrl:")]
    assert out.returncode == 1 and len(lines) == 1, out.stderr
    assert f"refused user {USER!r}" in lines[0] and "wrong-password-x2" not in out.stderr + out.stdout


async def test_an_untrusted_certificate_is_one_clear_line(
        run_id: str, mqtts_server: devstack.ServerProcess, pki: Pki, tmp_path: pathlib.Path) -> None:
    config = _config(run_id, mqtts_server, pki, tmp_path, ca_file=pki.other_ca_file)
    with pytest.raises(ControlPlaneError, match="TLS certificate not trusted") as info:
        async with ControlPlane(config, f"{run_id}-wrong-ca", connect_timeout_s=scaled(20)):
            pass
    assert "\n" not in str(info.value) and str(pki.other_ca_file) in str(info.value)
