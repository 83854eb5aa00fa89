"""A unique secret planted in every secret field never shows: not in `config check`, not in any output
or log of the demo in miniature (trainer, replicators, agents, audit, brokers), not in `status`.

The secrets come from each kind of source (inline, `*_file`, `*_env`). The MQTT password is really
used: the demo's broker then accepts that user and password only. The signing key is a real Ed25519
private key (the trainer signs with it), so it is planted as a second, hex secret.
"""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys
import uuid
from typing import Any

import pytest
import yaml
from demo_testkit import STALL
from slowdown import scaled

from fleetrl import devstack
from fleetrl.config import load_config, secret_fields
from fleetrl.hub.signing import generate_ed25519

pytestmark = pytest.mark.e2e
ROOT = pathlib.Path(__file__).resolve().parents[2]
DEMO_TIMEOUT_S = 150  # the reference machine's figure: `_run` scales its bound


def _planted(tmp_path: pathlib.Path, secret: str, mqtt_port: int) -> dict[str, Any]:
    doc = yaml.safe_load((ROOT / "examples" / "fleet.demo.yaml").read_text())
    (tmp_path / "mqtt-password").write_text(secret + "-mqtt\n")
    doc["mqtt"].update(url=f"mqtt://127.0.0.1:{mqtt_port}", username="fleetrl",
                       password_file=str(tmp_path / "mqtt-password"))
    doc["hub"]["home_store"] = {"url": doc["hub"]["home_store"], "access_key_id": secret + "-home-id",
                                "secret_access_key_env": "PLANTED_S3_SECRET"}
    for region in doc["regions"]:
        region["kafka"] = {"bootstrap": f"127.0.0.1:{devstack.free_port()}", "sasl_password": secret + "-kafka"}
        region["store"] = {"url": region["store"], "access_key_id_env": "PLANTED_S3_ID",
                           "secret_access_key": secret + "-store"}
    return doc


def _run(argv: list[str], env: dict[str, str], timeout_s: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "fleetrl.cli", *argv], capture_output=True, text=True, env=env,
                          timeout=scaled(timeout_s), check=False)


def test_a_planted_secret_shows_nowhere(tmp_path: pathlib.Path) -> None:
    secret = f"planted-{uuid.uuid4().hex}"
    private, _ = generate_ed25519()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "FLEETRL_HUB_KEY": private,
           "PLANTED_S3_SECRET": secret + "-s3env", "PLANTED_S3_ID": secret + "-s3id"}
    path = tmp_path / "fleet.yaml"
    path.write_text(yaml.safe_dump(_planted(tmp_path, secret, devstack.free_port())))
    config = load_config(path, env=env)
    resolved = {f.path: f.value(env) for f in secret_fields(config)}
    assert all(resolved.values()), f"a secret field was left unplanted: {resolved}"
    shown: list[tuple[str, str]] = []

    for argv in (["config", "check", "--config", str(path)], ["config", "check", "--json", "--config", str(path)]):
        out = _run(argv, env)
        assert out.returncode == 0 and "**********" in out.stdout, out.stderr
        shown.append((" ".join(argv), out.stdout + out.stderr))

    work = tmp_path / "work"
    demo = _run(["demo", "--config", str(path), *STALL, "--workdir", str(work), "--steps", "2"], env, DEMO_TIMEOUT_S)
    assert demo.returncode == 0, demo.stdout[-3000:] + demo.stderr[-3000:]
    shown.append(("demo", demo.stdout + demo.stderr))
    logs = sorted((work / "logs").glob("*.log"))
    assert {"trainer.log", "audit.log"} <= {p.name for p in logs} and any("agent-" in p.name for p in logs)
    shown += [(str(p), p.read_text(errors="replace")) for p in [*logs, work / "summary.json", work / "fleet.yaml"]]

    users = {"fleetrl": secret + "-mqtt"}
    with devstack.mqtt_broker(workdir=tmp_path, users=users) as broker:
        doc = yaml.safe_load(path.read_text())
        doc["mqtt"]["url"] = f"mqtt://127.0.0.1:{broker.port}"
        path.write_text(yaml.safe_dump(doc))
        status = _run(["status", "--config", str(path), "--wait-s", "0.5"], env)
        assert status.returncode == 0, status.stderr
        shown.append(("status", status.stdout + status.stderr))

    leaks = [where for where, text in shown if secret in text or private in text]
    assert not leaks, f"a planted secret shows in {leaks}"
