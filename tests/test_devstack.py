"""The dev-stack servers start, answer their protocol, and stop by PID."""

from __future__ import annotations

import asyncio
import pathlib

import pytest
from slowdown import scaled

from fleetrl import devstack

pytestmark = pytest.mark.integration


async def test_tansu_answers_kafka_metadata(tansu_bootstrap: str) -> None:
    from aiokafka.admin import AIOKafkaAdminClient

    admin = AIOKafkaAdminClient(bootstrap_servers=tansu_bootstrap)
    await admin.start()
    try:
        assert isinstance(await admin.list_topics(), list)
    finally:
        await admin.close()


async def test_mqtt_broker_round_trips_a_retained_message(mqtt_server: devstack.ServerProcess, run_id: str) -> None:
    import aiomqtt

    topic = f"fleetrl/{run_id}/probe"
    async with aiomqtt.Client("127.0.0.1", mqtt_server.port) as client:
        await client.publish(topic, b"hello", qos=1, retain=True)
    async with aiomqtt.Client("127.0.0.1", mqtt_server.port) as client:
        await client.subscribe(topic, qos=1)
        async with asyncio.timeout(scaled(5)):
            async for message in client.messages:
                if message.topic.matches(topic):
                    assert message.payload == b"hello"
                    break


def test_moto_serves_s3_over_http(s3_endpoint: str, s3_bucket: str) -> None:
    import boto3

    s3 = boto3.client("s3", endpoint_url=s3_endpoint, region_name="us-east-1")
    s3.put_object(Bucket=s3_bucket, Key="k", Body=b"v")
    assert s3.get_object(Bucket=s3_bucket, Key="k")["Body"].read() == b"v"


def test_stop_ends_only_the_started_process() -> None:
    server = devstack.tansu().start()
    pid = server.pid
    server.stop()
    assert not server.alive()
    with pytest.raises(ProcessLookupError):
        import os

        os.kill(pid, 0)


def test_start_failure_names_the_server() -> None:
    server = devstack.ServerProcess("nothing", ["false"], devstack.free_port())
    with pytest.raises(devstack.DevStackError, match="nothing"):
        server.start(ready_timeout_s=scaled(2))


def test_free_ports_of_processes_side_by_side_never_overlap() -> None:
    """Each process (an xdist worker, a demo) draws from blocks only it holds, below the kernel's
    ephemeral range: three processes asking at once are never handed the same port."""
    import subprocess
    import sys

    draw = "from fleetrl import devstack; print(*(devstack.free_port() for _ in range(100)))"
    procs = [subprocess.Popen([sys.executable, "-c", draw], stdout=subprocess.PIPE, text=True) for _ in range(3)]
    drawn = [set(map(int, p.communicate(timeout=scaled(60))[0].split())) for p in procs]
    assert all(len(ports) == 100 for ports in drawn)
    assert not (drawn[0] & drawn[1]) and not (drawn[0] & drawn[2]) and not (drawn[1] & drawn[2])
    ephemeral_low = int(pathlib.Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    assert all(20000 <= port < ephemeral_low for ports in drawn for port in ports)
