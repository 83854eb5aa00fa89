"""Loopback TCP relays the demo can cut: a region's links home under `--partition`.

A `Relay` listens on one loopback port and copies bytes both ways to a target port. `cut()` closes
the connections of the home side and refuses new ones until `heal()`, which is what a lost WAN
link looks like to both ends (connections reset, reconnects failing) while everything inside the
region keeps working:

* Kafka: the region's tansu advertises the relay's port, so every client reaches the broker through
  it; `home_pids` names the processes on the home side (the trainer) and only their connections are
  cut (their peer address is one of those processes' sockets, found with psutil). The region's own
  agents go on producing into their Kafka.
* MQTT and the home object store: the region's processes reach them through a relay of their own
  (their config names its port), so cutting it cuts every connection it carries.

All relays of a demo run on one asyncio loop in a background thread (`RelayHub`).
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import psutil

from fleetrl.devstack import free_port

_CHUNK = 1 << 16
_CONNECT_TIMEOUT_S = 5.0


@dataclass(eq=False)
class _Link:
    home: bool
    writers: list[asyncio.StreamWriter] = field(default_factory=list)

    def close(self) -> None:
        """Reset both sides at once: a cut link drops what it still buffers, as a lost WAN link does (a
        graceful close would wait, holding the socket, for a peer that may never read it)."""
        for w in self.writers:
            w.transport.abort()


class Relay:
    """127.0.0.1:`port` -> 127.0.0.1:`target`; `home_pids`: None (every connection is home's) or the
    processes whose connections count as home's."""

    def __init__(self, name: str, target: int, home_pids: Callable[[], list[int]] | None = None,
                 port: int | None = None) -> None:
        self.name, self.target, self.home_pids = name, target, home_pids
        self.port = port or free_port()
        self.is_cut = False
        self.links: set[_Link] = set()
        self.refused = 0
        self._server: asyncio.Server | None = None

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._accept, "127.0.0.1", self.port)

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()
        for link in list(self.links):
            link.close()

    def cut(self) -> None:
        self.is_cut = True
        for link in [k for k in self.links if k.home]:
            link.close()

    def heal(self) -> None:
        self.is_cut = False

    def _is_home(self, peer: tuple[str, int]) -> bool:
        if self.home_pids is None:
            return True
        for pid in self.home_pids():
            with contextlib.suppress(psutil.Error):
                if any(c.laddr and (c.laddr.ip, c.laddr.port) == peer[:2]
                       for c in psutil.Process(pid).net_connections(kind="tcp")):
                    return True
        return False

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        home = self._is_home(writer.get_extra_info("peername"))
        if home and self.is_cut:
            self.refused += 1
            writer.close()
            return
        try:
            up_r, up_w = await asyncio.wait_for(asyncio.open_connection("127.0.0.1", self.target),
                                                _CONNECT_TIMEOUT_S)
        except (OSError, TimeoutError):
            writer.close()  # the target is down (a killed broker): the client retries as it would
            return
        link = _Link(home, [writer, up_w])
        self.links.add(link)
        try:
            await asyncio.gather(_pipe(reader, up_w), _pipe(up_r, writer))
        finally:
            link.close()
            self.links.discard(link)


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while chunk := await reader.read(_CHUNK):
            writer.write(chunk)
            await writer.drain()
    except (OSError, asyncio.IncompleteReadError):
        pass
    finally:
        with contextlib.suppress(OSError, RuntimeError):
            writer.close()


class RelayHub:
    """The demo's relays on one event loop in a daemon thread; calls from the demo's thread are
    bounded."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.relays: dict[str, Relay] = {}
        self._thread = threading.Thread(target=self.loop.run_forever, name="fleetrl-demo-relays", daemon=True)
        self._thread.start()

    def _call(self, coro: Any, timeout_s: float = 10.0) -> Any:
        fut: Future[Any] = asyncio.run_coroutine_threadsafe(coro, self.loop)
        return fut.result(timeout=timeout_s)

    def add(self, relay: Relay) -> Relay:
        self._call(relay.start())
        self.relays[relay.name] = relay
        return relay

    def cut(self, prefix: str) -> list[str]:
        """Cut every relay whose name starts with `prefix` (a region's links: `<region>/`)."""
        return self._each(prefix, "cut")

    def heal(self, prefix: str) -> list[str]:
        return self._each(prefix, "heal")

    def _each(self, prefix: str, action: str) -> list[str]:
        names = [n for n in self.relays if n.startswith(prefix)]

        async def run() -> None:
            for n in names:
                getattr(self.relays[n], action)()

        self._call(run())
        return names

    def close(self) -> None:
        """Close every relay and its connections, end the tasks still copying, then the loop: nothing is
        left for the garbage collector to find open (an unclosed transport is a ResourceWarning there,
        raised at whatever runs next)."""
        async def run() -> None:
            for relay in self.relays.values():
                await relay.close()
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            for _ in range(3):  # the aborted transports close their sockets in callbacks of the next rounds
                await asyncio.sleep(0)

        with contextlib.suppress(Exception):
            self._call(run())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout=5)
        if not self._thread.is_alive():
            self.loop.close()
