"""fetch-secrets.py (the nodes' boot-time secret fetcher) against a real moto server over HTTP."""

from __future__ import annotations

import grp
import json
import os
import pathlib
import subprocess
import sys
import uuid

import boto3
import pytest
from slowdown import scaled
from tf_support import TF_ROOT

SCRIPT = TF_ROOT / "modules" / "node-bootstrap" / "templates" / "fetch-secrets.py"
pytestmark = pytest.mark.integration


def _run(endpoint: str, spec: dict[str, object], tmp_path: pathlib.Path) -> subprocess.CompletedProcess[str]:
    (tmp_path / "secrets.json").write_text(json.dumps(spec))
    env = {**os.environ, "AWS_ENDPOINT_URL": endpoint}
    group = grp.getgrgid(os.getgid()).gr_name
    return subprocess.run(
        [sys.executable, str(SCRIPT), str(tmp_path / "secrets.json"), str(tmp_path / "run" / "env"),
         "--node", "i-0abc", "--file-group", group],
        env=env, capture_output=True, text=True, timeout=scaled(60),
    )


def _secret(endpoint: str, value: str) -> str:
    client = boto3.client("secretsmanager", endpoint_url=endpoint, region_name="us-east-1")
    return str(client.create_secret(Name=f"fleetrl-{uuid.uuid4().hex[:8]}", SecretString=value)["ARN"])


def test_env_file_and_secret_files(s3_endpoint: str, tmp_path: pathlib.Path) -> None:
    hub = _secret(s3_endpoint, "k3y$with\"quote")
    kafka = _secret(s3_endpoint, json.dumps({"username": "fleetrl", "password": "pw1"}))
    pub = _secret(s3_endpoint, "-----BEGIN PUBLIC KEY-----\nabc\n-----END PUBLIC KEY-----")
    spec = {"env": {"FLEETRL_HUB_KEY": {"arn": hub, "json_key": None},
                    "FLEETRL_KAFKA_PASSWORD_US_WEST_2": {"arn": kafka, "json_key": "password"}},
            "files": {str(tmp_path / "hub.pub"): {"arn": pub, "json_key": None}}}
    proc = _run(s3_endpoint, spec, tmp_path)
    assert proc.returncode == 0, proc.stderr
    env_file = tmp_path / "run" / "env"
    assert env_file.read_text().splitlines() == [
        "FLEETRL_NODE=i-0abc", 'FLEETRL_HUB_KEY="k3y\\$with\\"quote"', 'FLEETRL_KAFKA_PASSWORD_US_WEST_2="pw1"']
    assert env_file.stat().st_mode & 0o777 == 0o600
    assert (tmp_path / "hub.pub").read_text().startswith("-----BEGIN PUBLIC KEY-----\nabc\n")


def test_missing_secret_names_it_and_writes_nothing(s3_endpoint: str, tmp_path: pathlib.Path) -> None:
    arn = "arn:aws:secretsmanager:us-east-1:000000000000:secret:fleetrl-absent-AbCdEf"
    proc = _run(s3_endpoint, {"env": {"FLEETRL_MQTT_PASSWORD": {"arn": arn, "json_key": None}}}, tmp_path)
    assert proc.returncode == 1
    assert "FLEETRL_MQTT_PASSWORD" in proc.stderr and "fleetrl-absent" in proc.stderr
    assert not (tmp_path / "run" / "env").exists()


def test_multiline_value_refused_for_env(s3_endpoint: str, tmp_path: pathlib.Path) -> None:
    arn = _secret(s3_endpoint, "line1\nline2")
    proc = _run(s3_endpoint, {"env": {"FLEETRL_HUB_KEY": {"arn": arn, "json_key": None}}}, tmp_path)
    assert proc.returncode == 1 and "FLEETRL_HUB_KEY" in proc.stderr and "several lines" in proc.stderr


def test_wrong_json_key_named(s3_endpoint: str, tmp_path: pathlib.Path) -> None:
    arn = _secret(s3_endpoint, json.dumps({"username": "fleetrl", "pass": "x"}))
    proc = _run(s3_endpoint, {"env": {"FLEETRL_MQTT_PASSWORD": {"arn": arn, "json_key": "password"}}}, tmp_path)
    assert proc.returncode == 1 and "no JSON key 'password'" in proc.stderr


def test_waits_for_a_value_stored_later(s3_endpoint: str, tmp_path: pathlib.Path) -> None:
    # A secret created without a value (as Terraform does for an Ed25519 key) is waited for.
    client = boto3.client("secretsmanager", endpoint_url=s3_endpoint, region_name="us-east-1")
    arn = client.create_secret(Name=f"fleetrl-{uuid.uuid4().hex[:8]}")["ARN"]
    (tmp_path / "secrets.json").write_text(json.dumps({"env": {"FLEETRL_HUB_KEY": {"arn": arn, "json_key": None}}}))
    with subprocess.Popen(
        [sys.executable, str(SCRIPT), str(tmp_path / "secrets.json"), str(tmp_path / "env"), "--node", "n1",
         "--wait-s", str(scaled(30))],
        env={**os.environ, "AWS_ENDPOINT_URL": s3_endpoint}, stderr=subprocess.PIPE, text=True,
    ) as proc:
        try:
            assert proc.stderr is not None
            assert "retrying" in proc.stderr.readline()  # it found no value and is waiting
            client.put_secret_value(SecretId=arn, SecretString="0123abcd")
            assert proc.wait(timeout=scaled(30)) == 0
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait(timeout=scaled(10))
    assert 'FLEETRL_HUB_KEY="0123abcd"' in (tmp_path / "env").read_text()
