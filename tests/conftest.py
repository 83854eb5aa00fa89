"""Shared fixtures: real servers on free loopback ports, stopped by the fixture that started them.

Servers are module-scoped where tests only use them (each test takes a fresh run id, so topics and
MQTT paths never collide); tests that kill or restart a server build their own with the factories
in `fleetrl.devstack`.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator

import pytest

from fleetrl import devstack

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
# boto3 must never look for real credentials or reach AWS from a test.
os.environ.setdefault("AWS_ACCESS_KEY_ID", "fleetrl")
os.environ.setdefault("AWS_SECRET_ACCESS_KEY", "fleetrl")
os.environ.setdefault("AWS_DEFAULT_REGION", "us-east-1")


@pytest.fixture
def run_id() -> str:
    """A run id unique to the test: topics, MQTT paths and store keys never collide."""
    return f"t{uuid.uuid4().hex[:10]}"


@pytest.fixture(scope="module")
def tansu() -> Iterator[devstack.ServerProcess]:
    """A tansu broker (memory storage); `.port` is its Kafka port on 127.0.0.1."""
    with devstack.tansu() as server:
        yield server


@pytest.fixture(scope="module")
def tansu_bootstrap(tansu: devstack.ServerProcess) -> str:
    return f"127.0.0.1:{tansu.port}"


@pytest.fixture(scope="module")
def mqtt_server() -> Iterator[devstack.ServerProcess]:
    """An MQTT broker: mosquitto where installed, else amqtt."""
    with devstack.mqtt_broker() as server:
        yield server


@pytest.fixture(scope="module")
def moto_server() -> Iterator[devstack.ServerProcess]:
    """moto's S3 server mode; `.port` on 127.0.0.1, reached over real HTTP with boto3."""
    with devstack.moto_s3() as server:
        yield server


@pytest.fixture(scope="module")
def s3_endpoint(moto_server: devstack.ServerProcess) -> str:
    return f"http://127.0.0.1:{moto_server.port}"


@pytest.fixture
def s3_bucket(s3_endpoint: str) -> str:
    """A fresh bucket on the moto server; returns its name."""
    import boto3

    name = f"b-{uuid.uuid4().hex[:12]}"
    boto3.client("s3", endpoint_url=s3_endpoint, region_name="us-east-1").create_bucket(Bucket=name)
    return name
