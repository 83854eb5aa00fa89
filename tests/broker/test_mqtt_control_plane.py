"""The MQTT control plane against a real broker (mosquitto where installed, else amqtt)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import pathlib
import signal
import subprocess
import sys

import pytest
from broker_testkit import commands_listening, fleet_yaml, make_config, next_command, wait_for, write_config
from slowdown import scaled

from fleetrl import devstack
from fleetrl.broker import ControlCommand, ControlPlane, ControlPlaneError, Heartbeat, PolicyAnnouncement
from fleetrl.broker.naming import policy_topic
from fleetrl.config import FleetConfig

pytestmark = pytest.mark.integration
HERE = pathlib.Path(__file__).parent


def _config(run_id: str, port: int) -> FleetConfig:
    return make_config(fleet_yaml(run_id, "127.0.0.1:9", mqtt_port=port))


def _policy(version: int) -> PolicyAnnouncement:
    return PolicyAnnouncement(version=version, manifest=f"run/versions/{version:012d}.json", anchor=0,
                              sha256="ab" * 32, published_at=1.0)


async def test_late_subscriber_sees_the_retained_policy(run_id: str, mqtt_server: devstack.ServerProcess) -> None:
    config = _config(run_id, mqtt_server.port)
    async with ControlPlane(config, f"{run_id}-trainer") as trainer:
        await trainer.announce_policy(_policy(2))
        await trainer.announce_policy(_policy(3))
    async with ControlPlane(config, f"{run_id}-late") as late:
        announced = await late.wait_for_policy(3, timeout_s=scaled(10))
    assert announced == _policy(3)


async def test_killed_node_is_marked_offline_by_its_last_will(
    run_id: str, mqtt_server: devstack.ServerProcess, tmp_path: pathlib.Path
) -> None:
    path = write_config(fleet_yaml(run_id, "127.0.0.1:9", mqtt_port=mqtt_server.port), tmp_path / "fleet.yaml")
    config = _config(run_id, mqtt_server.port)
    async with ControlPlane(config, f"{run_id}-observer") as observer:
        with subprocess.Popen([sys.executable, str(HERE / "mqtt_node.py"), str(path), "r1", "n7"],
                              stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True) as node:
            try:
                line = await asyncio.wait_for(asyncio.to_thread(node.stdout.readline), scaled(30))  # type: ignore[union-attr]
                assert line.strip() == "ready"
                assert await wait_for(lambda: ("r1", "n7") in observer.nodes, 10)
                assert observer.nodes[("r1", "n7")].state == "up"
            finally:
                os.kill(node.pid, signal.SIGKILL)
                node.wait(timeout=scaled(10))
        assert await wait_for(lambda: observer.nodes[("r1", "n7")].state == "offline", 10)
    # The offline state is retained: a client that connects later sees it too.
    async with ControlPlane(config, f"{run_id}-later") as later:
        assert await wait_for(lambda: ("r1", "n7") in later.nodes, 10)
        assert later.nodes[("r1", "n7")].state == "offline"


async def test_graceful_close_marks_the_node_offline(run_id: str, mqtt_server: devstack.ServerProcess) -> None:
    config = _config(run_id, mqtt_server.port)
    async with ControlPlane(config, f"{run_id}-observer") as observer:
        async with ControlPlane(config, f"{run_id}-node", will=("r1", "n1"), watch_nodes=False) as node:
            await node.heartbeat("r1", "n1", Heartbeat(state="draining", version=4, tokens_per_s=12.5))
            assert await wait_for(lambda: ("r1", "n1") in observer.nodes, 10)
            assert observer.nodes[("r1", "n1")].state == "draining"
            assert observer.nodes[("r1", "n1")].tokens_per_s == 12.5
        assert await wait_for(lambda: observer.nodes[("r1", "n1")].state == "offline", 10)


async def test_commands_reach_the_region_and_bad_payloads_are_ignored(
    run_id: str, mqtt_server: devstack.ServerProcess
) -> None:
    import aiomqtt

    config = _config(run_id, mqtt_server.port)
    async with ControlPlane(config, f"{run_id}-node", watch_nodes=False) as node, \
            ControlPlane(config, f"{run_id}-operator") as operator:
        commands = node.commands("r1")
        await commands_listening(commands, operator, "r1")  # the subscription is in place
        # Garbage on the policy topic and a malformed command are logged and skipped.
        async with aiomqtt.Client("127.0.0.1", mqtt_server.port) as raw:
            await raw.publish(policy_topic(run_id), b"{not json", qos=1)
            await raw.publish(f"fleetrl/{run_id}/control/r1", b'{"cmd": "explode"}', qos=1)
        await operator.send_control("r1", ControlCommand(cmd="drain", reason="maintenance"))
        got = await next_command(commands)
        await operator.announce_policy(_policy(1))
        assert (await node.wait_for_policy(1, timeout_s=scaled(10))).version == 1
        await commands.aclose()
    assert got == ControlCommand(cmd="drain", reason="maintenance")


async def test_reconnected_client_recovers_retained_state(run_id: str, mqtt_server: devstack.ServerProcess) -> None:
    """The node's link to the broker drops; a policy is announced meanwhile; on reconnect it is there."""
    async with _Link(mqtt_server.port) as link:
        node_config = _config(run_id, link.port)
        async with ControlPlane(node_config, f"{run_id}-node") as node, \
                ControlPlane(_config(run_id, mqtt_server.port), f"{run_id}-trainer") as trainer:
            await trainer.announce_policy(_policy(1))
            await node.wait_for_policy(1, timeout_s=scaled(10))
            await link.cut()
            assert await wait_for(lambda: not node._connected.is_set(), 10)
            await trainer.announce_policy(_policy(2))  # while the node cannot hear it
            await trainer.heartbeat("r1", "n9", Heartbeat(state="up", version=2))
            await asyncio.sleep(0.5)
            assert node.policy is not None and node.policy.version == 1
            await link.restore()
            assert (await node.wait_for_policy(2, timeout_s=scaled(15))).version == 2
            assert await wait_for(lambda: ("r1", "n9") in node.nodes, 10)
            assert node.connections >= 2


async def test_unreachable_broker_fails_with_a_clear_error(run_id: str) -> None:
    config = _config(run_id, devstack.free_port())
    with pytest.raises(ControlPlaneError, match="not reachable"):
        async with ControlPlane(config, f"{run_id}-x", connect_timeout_s=1.0):
            pass


class _Link:
    """A TCP relay to the broker that the test can cut (dropping connections, refusing new ones)."""

    def __init__(self, upstream_port: int) -> None:
        self.upstream, self.port = upstream_port, devstack.free_port()
        self._server: asyncio.Server | None = None
        self._pipes: set[asyncio.Task[None]] = set()

    async def __aenter__(self) -> _Link:
        await self.restore()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.cut()

    async def restore(self) -> None:
        self._server = await asyncio.start_server(self._relay, "127.0.0.1", self.port)

    async def cut(self) -> None:
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()
            self._server = None
        for task in list(self._pipes):
            task.cancel()
        await asyncio.gather(*self._pipes, return_exceptions=True)

    async def _relay(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._pipes.add(task)
        up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.upstream)
        try:
            await asyncio.gather(_pipe(reader, up_writer), _pipe(up_reader, writer))
        finally:
            for w in (writer, up_writer):
                w.close()
                with contextlib.suppress(Exception):
                    await w.wait_closed()
            self._pipes.discard(task)


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    while data := await reader.read(65536):
        writer.write(data)
        await writer.drain()
    writer.close()


async def test_a_dead_connection_task_surfaces_its_exception(
    run_id: str, mqtt_server: devstack.ServerProcess
) -> None:
    config = _config(run_id, mqtt_server.port)
    async with ControlPlane(config, f"{run_id}-trainer") as trainer, ControlPlane(config, f"{run_id}-node") as node:
        def broken(topic: str, payload: object) -> None:
            raise RuntimeError("bug in a handler")

        node._dispatch = broken  # type: ignore[method-assign]
        await trainer.announce_policy(_policy(1))
        with pytest.raises(ControlPlaneError, match="bug in a handler"):
            await node.wait_for_policy(1, timeout_s=scaled(10))
        with pytest.raises(ControlPlaneError, match="died"):
            await node.announce_policy(_policy(2))


async def test_a_cancel_lost_in_an_acknowledgement_wait_is_raised_again() -> None:
    """aiomqtt waits for PUBACK with `asyncio.wait_for`; on Python 3.11 a cancel that lands in the same
    loop turn as the acknowledgement is swallowed there. The publish path must still end cancelled (an
    agent whose heartbeat loop lost its cancel never exited after SIGTERM)."""
    from fleetrl.broker.mqtt import _raise_swallowed_cancel

    async def publish(ack: asyncio.Future[None], guarded: bool) -> str:
        await asyncio.wait_for(ack, timeout=scaled(10))  # the shape of aiomqtt's PUBACK wait
        if guarded:
            _raise_swallowed_cancel()
        return "returned"

    outcomes = {}
    for guarded in (False, True):
        ack: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        task = asyncio.create_task(publish(ack, guarded))
        await asyncio.sleep(0)  # the task now waits for its acknowledgement
        ack.set_result(None)  # the PUBACK arrives...
        task.cancel()  # ...as the agent cancels its heartbeat loop
        await asyncio.wait({task}, timeout=scaled(5))
        outcomes[guarded] = "cancelled" if task.cancelled() else task.result()
    assert outcomes[True] == "cancelled"
    if sys.version_info < (3, 12):  # the library behaviour this guards against is real here
        assert outcomes[False] == "returned"
