"""Secret fields: where their values come from, and that nothing shows them (reprs, dumps, logs, errors)."""

from __future__ import annotations

import io
import json
import pathlib
import sys

import pytest
import yaml

from fleetrl import log
from fleetrl.config import SecretError, SecretField, parse_config, secret_fields

BASE = {"run": "r", "regions": [{"name": "a", "kafka": "127.0.0.1:9", "store": "/tmp/s"}]}
SECRET_PATHS = {"hub.home_store.access_key_id", "hub.home_store.secret_access_key", "hub.signing.key",
                "mqtt.password", "regions[a].kafka.sasl_password", "regions[a].store.access_key_id",
                "regions[a].store.secret_access_key"}


def test_every_secret_of_the_issue_is_a_secret_field() -> None:
    config = parse_config(yaml.safe_dump(BASE), env={})
    assert {f.path for f in secret_fields(config)} == SECRET_PATHS


def test_sources_file_then_inline_then_environment(tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch) -> None:
    creds = tmp_path / "creds"
    creds.mkdir()
    (creds / "mqtt").write_text("from-a-file-1\n")
    monkeypatch.setenv("CREDENTIALS_DIRECTORY", str(creds))  # as systemd's LoadCredential= sets it
    doc = {**BASE, "mqtt": {"password_file": "$CREDENTIALS_DIRECTORY/mqtt", "password": "inline-2",
                            "password_env": "MQTT_PW"}}
    config = parse_config(yaml.safe_dump(doc), env={})
    field = SecretField("mqtt.password", config.mqtt, "password")
    assert field.value({"MQTT_PW": "from-env-3"}) == "from-a-file-1"
    config.mqtt.password_file = None
    assert field.value({"MQTT_PW": "from-env-3"}) == "inline-2"
    config.mqtt.password = None
    assert field.value({"MQTT_PW": "from-env-3"}) == "from-env-3"
    assert field.value({}) is None


def test_an_unreadable_secret_file_names_the_field_not_a_value(tmp_path: pathlib.Path) -> None:
    doc = {**BASE, "mqtt": {"password_file": str(tmp_path / "missing")}}
    config = parse_config(yaml.safe_dump(doc), env={})
    with pytest.raises(SecretError, match=r"^mqtt.password_file: cannot read secret file .*missing"):
        SecretField("mqtt.password", config.mqtt, "password").value()


def test_reprs_and_dumps_hide_inline_secrets() -> None:
    doc = {**BASE, "mqtt": {"password": "hunter2-inline"}}
    config = parse_config(yaml.safe_dump(doc), env={})
    for text in (repr(config), str(config.mqtt), json.dumps(config.model_dump(mode="json"))):
        assert "hunter2-inline" not in text
    assert config.model_dump(mode="json")["mqtt"]["password"] == "**********"


def test_logs_and_error_lines_redact_registered_secrets(monkeypatch: pytest.MonkeyPatch) -> None:
    out = io.StringIO()
    monkeypatch.setattr(sys, "stderr", out)
    log.configure(json=True)
    log.register_secret("s3cr3t-token-42")
    logger = log.get_logger("test")
    try:
        raise RuntimeError("login failed for s3cr3t-token-42")
    except RuntimeError:
        logger.exception("kafka.login", password="s3cr3t-token-42", nested={"k": ["x s3cr3t-token-42"]})
    text = out.getvalue()
    assert "s3cr3t-token-42" not in text and text.count(log.REDACTED) >= 3
    assert log.redact("error: s3cr3t-token-42 refused") == f"error: {log.REDACTED} refused"
