"""The MQTT control plane client (aiomqtt): policy announcements, heartbeats, control commands.

One background task per `ControlPlane` holds the connection: it subscribes, keeps `policy` and
`nodes` current from the (retained) messages, routes commands to `commands(region)` iterators, and
reconnects with exponential backoff capped at `mqtt.reconnect_max_s`. A reconnected client
re-subscribes and so recovers the retained state. Payloads that fail validation are logged with
their topic and ignored. If the task dies of anything but a connection loss, every later call
raises `ControlPlaneError` from that exception instead of waiting forever.

amqtt sends a connecting client the retained messages of every filter any client ever subscribed
to, so messages are filtered by topic on receipt, never trusted to match our subscriptions.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import ssl
import urllib.parse
from collections.abc import AsyncIterator
from types import TracebackType
from typing import Any

import aiomqtt
from pydantic import ValidationError

from fleetrl.broker.control import ControlCommand, Heartbeat, PolicyAnnouncement, ReplicaAnnouncement
from fleetrl.broker.errors import ControlPlaneError
from fleetrl.broker.naming import control_topic, node_topic, policy_topic, replica_topic
from fleetrl.config import FleetConfig, SecretError, SecretField
from fleetrl.log import get_logger

log = get_logger(__name__)
_FIRST_BACKOFF_S = 0.1
_QUEUE_SIZE = 256


class ControlPlane:
    """`async with ControlPlane(config, client_id, will=(region, node)) as cp: ...`."""

    def __init__(
        self,
        config: FleetConfig,
        client_id: str,
        will: tuple[str, str] | None = None,
        *,
        watch_nodes: bool = True,
        watch_replicas: bool = False,
        connect_timeout_s: float = 10.0,
        wait_connected: bool = True,
    ) -> None:
        self.config, self.client_id, self.will = config, client_id, will
        self.farewell: Heartbeat | None = None
        """The node's last heartbeat on a graceful close (default: `offline`)."""
        self.connect_timeout_s = connect_timeout_s
        self.wait_connected = wait_connected
        """False: entering does not wait for the broker (a daemon that must start while MQTT is down);
        the client connects in the background and publishes wait for it."""
        self.policy: PolicyAnnouncement | None = None
        self.nodes: dict[tuple[str, str], Heartbeat] = {}
        self.replicas: dict[str, ReplicaAnnouncement] = {}
        """The newest retained replica announcement of each region (with `watch_replicas`)."""
        run = config.run
        self._policy_topic, self._nodes_prefix, self._control_prefix, self._replicas_prefix = (
            policy_topic(run), f"fleetrl/{run}/nodes/", f"fleetrl/{run}/control/", f"fleetrl/{run}/replicas/")
        self._filters = ({self._policy_topic} | ({self._nodes_prefix + "+/+"} if watch_nodes else set())
                         | ({self._replicas_prefix + "+"} if watch_replicas else set()))
        self._queues: dict[str, list[asyncio.Queue[ControlCommand | BaseException]]] = {}
        self._client: aiomqtt.Client | None = None
        self._connected = asyncio.Event()
        self._changed = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._failure: BaseException | None = None
        self._closing = False
        self.connections = 0
        """How many times the client connected (1 + reconnects)."""

    # -- lifecycle ------------------------------------------------------------------------------

    async def __aenter__(self) -> ControlPlane:
        if self._task is not None or self._closing:
            raise ControlPlaneError(f"control plane client {self.client_id!r} cannot be started twice")
        self._task = asyncio.create_task(self._run(), name=f"mqtt-{self.client_id}")
        self._task.add_done_callback(self._on_task_done)
        if not self.wait_connected:
            return self
        try:
            async with asyncio.timeout(self.connect_timeout_s):
                await self._wait_connected()
        except TimeoutError as exc:
            await self.close(graceful=False)
            raise ControlPlaneError(f"MQTT broker {self.config.mqtt.url} not reachable within "
                                    f"{self.connect_timeout_s:.0f} s (client {self.client_id!r})") from exc
        except BaseException:
            await self.close(graceful=False)
            raise
        return self

    async def __aexit__(
        self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.close()

    async def close(self, graceful: bool = True) -> None:
        """Mark our node offline (a clean disconnect fires no last will), then disconnect. Bounded.

        `farewell`, set by the owner, is that last heartbeat (a region agent's says it `left`)."""
        if graceful and self.will is not None and self._connected.is_set() and self._failure is None:
            region, node = self.will
            with contextlib.suppress(ControlPlaneError):  # the broker is gone: nothing else to tell it
                await self.heartbeat(region, node, self.farewell or Heartbeat(state="offline"), timeout_s=2.0)
        self._closing = True
        task, self._task = self._task, None
        if task is not None and not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, TimeoutError):
                async with asyncio.timeout(5.0):
                    await task

    def _on_task_done(self, task: asyncio.Task[None]) -> None:
        if task.cancelled():
            return
        exc = task.exception()
        if exc is not None:
            self._failure = exc
            log.error("control.task_died", client_id=self.client_id, error=f"{type(exc).__name__}: {exc}")
            self._changed.set()
            for queues in self._queues.values():
                for q in queues:
                    with contextlib.suppress(asyncio.QueueFull):
                        q.put_nowait(exc)

    def _check_alive(self) -> None:
        if self._failure is not None:
            raise ControlPlaneError(f"control plane client {self.client_id!r} died: {self._failure}") from self._failure
        if self._closing:
            raise ControlPlaneError(f"control plane client {self.client_id!r} is closed")

    async def _wait_connected(self) -> None:
        while not self._connected.is_set():
            self._check_alive()
            waiter = asyncio.ensure_future(self._connected.wait())
            failure = asyncio.ensure_future(self._changed.wait())
            try:
                await asyncio.wait({waiter, failure}, return_when=asyncio.FIRST_COMPLETED)
            finally:
                waiter.cancel()
                failure.cancel()
            self._check_alive()

    # -- publishing -----------------------------------------------------------------------------

    async def announce_policy(self, announcement: PolicyAnnouncement) -> None:
        """Retained, QoS 1: every node, including ones that connect later, learns the version."""
        await self._publish(self._policy_topic, announcement.to_json(), retain=True)

    async def heartbeat(self, region: str, node: str, beat: Heartbeat, timeout_s: float | None = None) -> None:
        """Retained state of one node."""
        await self._publish(node_topic(self.config.run, region, node), beat.to_json(), retain=True, timeout_s=timeout_s)

    async def announce_replica(self, region: str, announcement: ReplicaAnnouncement,
                               timeout_s: float | None = None) -> None:
        """Retained, QoS 1: the region's workers (and any that join later) learn what their store holds."""
        await self._publish(replica_topic(self.config.run, region), announcement.to_json(), retain=True,
                            timeout_s=timeout_s)

    async def send_control(self, region: str, command: ControlCommand) -> None:
        """A command to the region's nodes (not retained: only connected nodes act on it)."""
        await self._publish(control_topic(self.config.run, region), command.to_json(), retain=False)

    async def _publish(self, topic: str, payload: bytes, retain: bool, timeout_s: float | None = None) -> None:
        timeout = timeout_s or max(5.0, 2 * self.config.mqtt.keepalive_s)
        try:
            async with asyncio.timeout(timeout):
                while True:  # a publish that failed on a dropped connection is retried after reconnect
                    await self._wait_connected()
                    client = self._client
                    try:
                        if client is not None:
                            await client.publish(topic, payload, qos=1, retain=retain)
                            _raise_swallowed_cancel()
                            return
                    except aiomqtt.MqttError as exc:
                        log.warning("control.publish_retry", topic=topic, error=str(exc))
                    await asyncio.sleep(_FIRST_BACKOFF_S)
        except TimeoutError as exc:
            raise ControlPlaneError(f"publish to {topic} on {self.config.mqtt.url} not acknowledged within "
                                    f"{timeout:.0f} s") from exc

    # -- reading --------------------------------------------------------------------------------

    async def wait_for_policy(self, min_version: int, timeout_s: float) -> PolicyAnnouncement:
        """The retained policy once its version is at least `min_version`."""
        try:
            async with asyncio.timeout(timeout_s):
                while self.policy is None or self.policy.version < min_version:
                    self._check_alive()
                    self._changed.clear()
                    await self._changed.wait()
        except TimeoutError as exc:
            have = None if self.policy is None else self.policy.version
            raise ControlPlaneError(f"no policy version >= {min_version} announced on {self._policy_topic} "
                                    f"within {timeout_s:.0f} s (latest: {have})") from exc
        return self.policy

    @property
    def connected(self) -> bool:
        return self._connected.is_set()

    async def changed(self, timeout_s: float) -> bool:
        """Wait up to `timeout_s` for the next change of the retained state (policy, replicas, nodes) or
        of the connection; True if one came. Raises ControlPlaneError if the client died."""
        self._check_alive()
        self._changed.clear()
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(timeout_s):
                await self._changed.wait()
                self._check_alive()
                return True
        return False

    async def commands(self, region: str) -> AsyncIterator[ControlCommand]:
        """Commands sent to `region` from now on; ends with ControlPlaneError if the client dies."""
        self._check_alive()
        queue: asyncio.Queue[ControlCommand | BaseException] = asyncio.Queue(_QUEUE_SIZE)
        self._queues.setdefault(region, []).append(queue)
        await self._subscribe(control_topic(self.config.run, region))
        try:
            while True:
                item = await queue.get()
                if isinstance(item, BaseException):
                    raise ControlPlaneError(f"control plane client {self.client_id!r} died: {item}") from item
                yield item
        finally:
            self._queues[region].remove(queue)

    async def _subscribe(self, topic_filter: str) -> None:
        if topic_filter in self._filters:
            return
        self._filters.add(topic_filter)
        client = self._client
        if client is not None and self._connected.is_set():
            with contextlib.suppress(aiomqtt.MqttError):  # on failure, the reconnect subscribes it
                await client.subscribe(topic_filter, qos=1)
            _raise_swallowed_cancel()

    # -- the connection task --------------------------------------------------------------------

    async def _run(self) -> None:
        delay = _FIRST_BACKOFF_S
        while not self._closing:
            try:
                async with self._make_client() as client:
                    for topic_filter in sorted(self._filters):
                        await client.subscribe(topic_filter, qos=1)
                    self._client = client
                    self.connections += 1
                    self._connected.set()
                    self._changed.set()
                    delay = _FIRST_BACKOFF_S
                    log.info("control.connected", client_id=self.client_id, url=self.config.mqtt.url,
                             connections=self.connections)
                    async for message in client.messages:
                        self._dispatch(str(message.topic), message.payload)
            except aiomqtt.MqttError as exc:
                refusal = _refusal(exc, self.config)
                if refusal is not None:  # retrying cannot help: fail once, with one line
                    raise ControlPlaneError(refusal) from exc
                log.warning("control.disconnected", client_id=self.client_id, error=str(exc), retry_in_s=delay)
            finally:
                self._connected.clear()
                self._client = None
            await asyncio.sleep(delay)
            delay = min(delay * 2, self.config.mqtt.reconnect_max_s)

    def _make_client(self) -> aiomqtt.Client:
        m = self.config.mqtt
        url = urllib.parse.urlparse(m.url)
        will = None
        if self.will is not None:
            region, node = self.will
            will = aiomqtt.Will(node_topic(self.config.run, region, node), Heartbeat(state="offline").to_json(),
                                qos=1, retain=True)
        kwargs: dict[str, Any] = {}
        if url.scheme == "mqtts":
            kwargs["tls_context"] = _tls_context(m.ca_file)
        try:
            password = SecretField("mqtt.password", m, "password").value()
        except SecretError as exc:
            raise ControlPlaneError(str(exc)) from exc
        if m.username is not None and password is None:
            raise ControlPlaneError(f"mqtt.username is {m.username!r} but no password is set (mqtt.password_file, "
                                    f"mqtt.password_env{f' = {m.password_env}' if m.password_env else ''})")
        return aiomqtt.Client(
            url.hostname or "127.0.0.1", url.port or (8883 if url.scheme == "mqtts" else 1883),
            identifier=self.client_id, username=m.username, password=password,
            keepalive=m.keepalive_s, will=will, clean_session=True, timeout=float(m.keepalive_s), **kwargs,
        )

    def _dispatch(self, topic: str, payload: Any) -> None:
        raw = bytes(payload) if isinstance(payload, bytes | bytearray) else str(payload).encode()
        try:
            if topic == self._policy_topic:
                self._on_policy(PolicyAnnouncement.model_validate(json.loads(raw)))
            elif topic.startswith(self._nodes_prefix):
                parts = topic[len(self._nodes_prefix):].split("/")
                if len(parts) == 2:
                    self.nodes[(parts[0], parts[1])] = Heartbeat.model_validate(json.loads(raw))
                    self._changed.set()
            elif topic.startswith(self._replicas_prefix):
                region = topic[len(self._replicas_prefix):]
                self._on_replica(region, ReplicaAnnouncement.model_validate(json.loads(raw)))
            elif topic.startswith(self._control_prefix):
                self._on_command(topic[len(self._control_prefix):], ControlCommand.model_validate(json.loads(raw)))
        except (ValueError, ValidationError) as exc:  # JSONDecodeError is a ValueError
            log.warning("control.bad_payload", topic=topic, error=str(exc).replace("\n", " ")[:300])

    def _on_policy(self, announcement: PolicyAnnouncement) -> None:
        if self.policy is None or announcement.version >= self.policy.version:
            self.policy = announcement
            self._changed.set()

    def _on_replica(self, region: str, announcement: ReplicaAnnouncement) -> None:
        known = self.replicas.get(region)
        if "/" not in region and (known is None or announcement.version >= known.version):
            self.replicas[region] = announcement
            self._changed.set()

    def _on_command(self, region: str, command: ControlCommand) -> None:
        for queue in self._queues.get(region, []):
            try:
                queue.put_nowait(command)
            except asyncio.QueueFull:
                log.error("control.command_dropped", region=region, cmd=command.cmd, reason="queue full")


def _raise_swallowed_cancel() -> None:
    """Re-raise a cancel that aiomqtt swallowed.

    aiomqtt waits for PUBACK and SUBACK with `asyncio.wait_for`, which on Python 3.11 returns the result
    when the cancel of the awaiting task lands in the same loop turn as the acknowledgement: the cancel
    is lost, and a loop that publishes (the agent's heartbeats) outlives its shutdown. The task still
    counts the request (`cancelling()`), so it is honoured here, right after the call that lost it.
    """
    task = asyncio.current_task()
    if task is not None and task.cancelling():
        raise asyncio.CancelledError


# CONNACK codes that mean "these credentials will never be accepted" (MQTT 3.1.1: 4, 5; MQTT 5: 134, 135).
_AUTH_CODES = {4: "bad user name or password", 5: "not authorized", 134: "bad user name or password",
               135: "not authorized"}


def _refusal(exc: aiomqtt.MqttError, config: FleetConfig) -> str | None:
    """One line for a connection failure no retry can fix (wrong credentials, untrusted certificate)."""
    m = config.mqtt
    rc = getattr(exc, "rc", None)
    code = getattr(rc, "value", rc)
    if isinstance(code, int) and code in _AUTH_CODES:
        who = f"user {m.username!r}" if m.username else "anonymous clients"
        return f"MQTT broker {m.url} refused {who}: {_AUTH_CODES[code]} (check mqtt.username and mqtt.password)"
    cause = exc.__cause__ or exc.__context__
    if isinstance(cause, ssl.SSLCertVerificationError) or "CERTIFICATE_VERIFY_FAILED" in str(exc):
        return f"MQTT broker {m.url}: TLS certificate not trusted ({getattr(cause, 'verify_message', cause)}; " \
               f"mqtt.ca_file = {m.ca_file})"
    return None


class _ClosingSSLSocket(ssl.SSLSocket):
    """paho leaves a socket whose TLS handshake failed open (a ResourceWarning per attempt): close it."""

    def do_handshake(self, block: bool = False) -> None:
        try:
            super().do_handshake(block)
        except BaseException:
            self.close()
            raise


def _tls_context(ca_file: str | None) -> ssl.SSLContext:
    """A verifying client context (hostname checked): the system CAs, or only `mqtt.ca_file` when set."""
    try:
        context = ssl.create_default_context(cafile=ca_file)
    except (OSError, ssl.SSLError) as exc:
        raise ControlPlaneError(f"cannot load mqtt.ca_file {ca_file}: {exc}") from exc
    context.sslsocket_class = _ClosingSSLSocket
    return context

