"""`fleetrl replicator --region R`: the hub's replicator daemon plus its control-plane announcements.

The replicator (`fleetrl.hub.replicator`) copies each version into the region store; after each pass
the lease holder tells `ReplicaAnnouncer` the newest version that store holds, and the announcer
publishes it, retained, on `fleetrl/<run>/replicas/<region>` (DESIGN.md §4). The region's agents
forward it to their workers, which pull it from the region store: no node polls the store, and none
reads across the WAN.

The same client listens: the retained policy announcement and the other regions' replica
announcements go into the replicator's `VersionHints`, so a region cut off from the home store
still learns of new versions and copies them from a peer that holds them.

The announcer runs its MQTT client on a loop of its own thread (the replicator is threaded, not
async), publishes only what changed, and publishes again after every reconnect, so a broker that
restarted without its retained state learns it back. MQTT being down never stops replication.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import threading

from fleetrl.broker import ControlPlane, ControlPlaneError, ReplicaAnnouncement
from fleetrl.config import FleetConfig
from fleetrl.crashpoints import crash_point
from fleetrl.hub import VersionHints
from fleetrl.log import get_logger

log = get_logger(__name__)
_CHECK_S = 1.0  # bound on how late a reconnect's re-announcement goes out


class ReplicaAnnouncer:
    """Thread-safe `announce(version, manifest_sha256, anchor)`; `close()` stops its thread (bounded)."""

    def __init__(self, config: FleetConfig, region: str, hints: VersionHints | None = None) -> None:
        self.config, self.region = config, region
        self.hints = hints or VersionHints()
        """Versions heard on the control plane (policy, peers' replicas), for the replicator."""
        self.published: ReplicaAnnouncement | None = None
        self._wanted: ReplicaAnnouncement | None = None
        self._lock = threading.Lock()
        self._loop = asyncio.new_event_loop()
        self._stop: asyncio.Event | None = None
        self._poke: asyncio.Event | None = None
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._loop.run_until_complete, args=(self._main(),),
                                        name=f"replicas-{region}", daemon=True)
        self._thread.start()
        self._ready.wait(5.0)

    def announce(self, version: int, manifest_sha256: str, anchor: int) -> None:
        with self._lock:
            if self._wanted is not None and self._wanted.version >= version:
                return
            self._wanted = ReplicaAnnouncement(version=version, manifest_sha256=manifest_sha256, anchor=anchor)
        if self._poke is not None:
            self._loop.call_soon_threadsafe(self._poke.set)

    def close(self, timeout_s: float = 5.0) -> None:
        if self._stop is not None and not self._loop.is_closed():
            self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(timeout_s)
        if not self._thread.is_alive():
            self._loop.close()

    async def _main(self) -> None:
        self._stop, self._poke = asyncio.Event(), asyncio.Event()
        self._ready.set()
        client_id = f"fleetrl-replicator-{self.region}-{os.getpid()}"
        async with ControlPlane(self.config, client_id, watch_nodes=False, watch_replicas=True,
                                wait_connected=False) as cp:
            announced_on = 0  # the connection (cp.connections) that carried our last announcement
            while not self._stop.is_set():
                self._listen(cp)
                with self._lock:
                    wanted = self._wanted
                if wanted is not None and cp.connected and (wanted != self.published or cp.connections != announced_on):
                    try:
                        await cp.announce_replica(self.region, wanted, timeout_s=5.0)
                        self.published, announced_on = wanted, cp.connections
                        log.info("replicator.announced", region=self.region, version=wanted.version)
                        crash_point("replicator.announced")
                    except ControlPlaneError as exc:
                        log.warning("replicator.announce_failed", region=self.region, error=str(exc))
                self._poke.clear()
                await self._wait(cp)

    def _listen(self, cp: ControlPlane) -> None:
        """Pass what the control plane heard into the hints (our own announcement excluded)."""
        if cp.policy is not None:
            self.hints.hear(VersionHints.POLICY, cp.policy.version)
        for region, replica in list(cp.replicas.items()):
            if region != self.region:
                self.hints.hear(region, replica.version)

    async def _wait(self, cp: ControlPlane) -> None:
        """Until a poke (something to announce), a change of the retained state, or _CHECK_S."""
        assert self._poke is not None
        poke = asyncio.ensure_future(self._poke.wait())
        change = asyncio.ensure_future(cp.changed(timeout_s=_CHECK_S))
        try:
            await asyncio.wait({poke, change}, timeout=_CHECK_S, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (poke, change):
                task.cancel()
            failed = (await asyncio.gather(poke, change, return_exceptions=True))[1]
        if isinstance(failed, ControlPlaneError):  # the client is gone: no change will wake us
            await asyncio.sleep(_CHECK_S)


def run_replicator(args: argparse.Namespace, config: FleetConfig) -> int:
    """The replicator daemon with its announcements (the handler of `fleetrl replicator`)."""
    from fleetrl.hub.cli import run_replicator as replicate
    from fleetrl.hub.errors import HubError

    try:
        config.region(args.region)
    except KeyError as exc:
        raise HubError(str(exc.args[0])) from None
    announcer = ReplicaAnnouncer(config, args.region)
    try:
        return replicate(args, config, on_holding=announcer.announce, hints=announcer.hints)
    finally:
        announcer.close()
