"""Replicator: copies each version into one region's store, crossing the WAN once per region.

One replicator per region does the work, elected by a lease in the region store (see lease.py).
For each version the region lacks, it reads the peer references (`holders/<N>/` in the home store),
picks the holder with the lowest link cost from this region, copies the manifest (verified) and
every object the region does not have yet (each checked against its sha256 before it is written),
and then writes the peer reference `holders/<N>/<region>` into the region store and the home store,
and moves the region's `latest`. Rollout nodes of the region read only their region store.

Home is not needed: the newest version is learned from the home store's `latest` and also from
`VersionHints` (the retained policy announcement and the peers' replica announcements, fed by the
`fleetrl replicator` daemon from the control plane), and a version is copied from any store that
holds it: a peer that announced it, or whose own store carries its holder reference. The manifest
is signed, so it is verified whichever store it came from. A region partitioned from home but not
from a peer keeps receiving weights; the home holder references it could not write then are
written once home answers again.

A LoRA run's versions are adapters on a base version of full weights (its manifest names it): a region
that starts from an adapter chain's anchor copies that base first, once.

An anchor's dense objects are not copied when the region holds the version before it: only the
anchor's delta crosses the WAN, and the dense objects are rebuilt here from the region's own chain
and kept only if byte for byte the published ones (see rebuild.py); any other is copied. So a region
that follows the chain receives only deltas over the WAN, one copy per version.

The parts: `pending.py` decides which versions the region still needs (holes, a LoRA base, a chain
restarted after gc), `copier.py` copies one (sources, verification, holder references, the lease
kept while copying); this module drives them, one pass per poll, and contends for the lease.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Mapping

from fleetrl.config import FleetConfig
from fleetrl.crashpoints import crash_point
from fleetrl.hub import manifest as mf
from fleetrl.hub.copier import Progress, VersionCopier
from fleetrl.hub.errors import HubError, LeaseLost, ObjectNotFound
from fleetrl.hub.lease import Lease
from fleetrl.hub.metrics import ReplicatorMetrics
from fleetrl.hub.pending import PendingVersions, VersionHints
from fleetrl.hub.signing import Keys, load_keys
from fleetrl.hub.stores import ObjectStore, open_store
from fleetrl.log import get_logger

__all__ = ["Holding", "Progress", "Replicator", "VersionHints"]

log = get_logger(__name__)
Holding = Callable[[int, str, int], None]
"""Told (version, manifest sha256, anchor) of the newest version the region store holds, after each pass
of the lease holder: the region agent's daemon announces it on the control plane (the hub knows no MQTT)."""


class Replicator:
    """Keeps the store of `region` up to date with the newest version, from home or from peers."""

    def __init__(self, config: FleetConfig, region: str, stores: Mapping[str, ObjectStore] | None = None,
                 holder: str | None = None, keys: Keys | None = None,
                 metrics: ReplicatorMetrics | None = None, hints: VersionHints | None = None) -> None:
        self.config, self.run, self.region = config, config.run, region
        given = dict(stores or {})
        self.stores = {name: given.get(name) or open_store(name, cfg, threads=config.hub.threads)
                       for name, cfg in config.stores().items()}
        self.local, self.home = self.stores[region], self.stores["home"]
        self.keys = keys or load_keys(config.hub.signing)
        self.lease = Lease(self.local, self.run, "replicator", config.hub.lease_ttl_s, holder)
        self.on_holding: Holding | None = None
        self.metrics = metrics or ReplicatorMetrics()
        self.hints = hints or VersionHints()
        self.copier = VersionCopier(config, region, self.stores, self.keys, self.lease, self.metrics,
                                    self.hints.holders)
        """How a version is copied (copier.py)."""
        self.plan = PendingVersions(self.copier, self.hints)
        """Which versions are copied, in what order (pending.py)."""

    @property
    def progress(self) -> Progress | None:
        """Told the bytes of each object copied (the CLI's progress line)."""
        return self.copier.progress

    @progress.setter
    def progress(self, value: Progress | None) -> None:
        self.copier.progress = value

    @property
    def rebuilt_bytes(self) -> int:
        """Bytes of dense anchor objects rebuilt in the region instead of copied (see rebuild.py)."""
        return self.copier.rebuilt_bytes

    @property
    def _holes(self) -> list[int] | None:
        return self.plan.holes

    def pending(self) -> list[int]:
        """Versions to copy, oldest first (`PendingVersions.pending`)."""
        return self.plan.pending()

    def newest(self) -> int | None:
        """The newest version known, from the home store or the announcements."""
        return self.plan.newest()

    def sources(self, version: int) -> list[ObjectStore]:
        """Stores holding `version`, nearest first (`VersionCopier.sources`)."""
        return self.copier.sources(version)

    def copy_version(self, version: int) -> int:
        """Copy one version's manifest and missing objects; returns the object bytes copied."""
        return self.copier.copy_version(version)

    # --- one pass ---------------------------------------------------------------------------

    def replicate_once(self, stop: threading.Event | None = None) -> list[int]:
        """Copy every pending version (the caller holds the lease); returns the versions copied.

        With `stop` set, the version being copied is finished and the rest left for the next holder.
        """
        done: list[int] = []
        self.copier.find_owed()
        self.copier.pay_home()
        todo = self.plan.pending()
        if len(todo) > 1:
            self.plan.log_route(todo)
        for i, version in enumerate(todo):
            if stop is not None and stop.is_set():
                break
            self.copier.keep_lease()
            try:
                self.copier.copy_version(version)
            except ObjectNotFound as exc:
                # In no store any more (gc at home ran while the region was away): the region's chain
                # starts again at the oldest version home holds, and what is below it goes.
                self.plan.restart_chain(version, exc)
                break
            self.plan.copied(version)
            done.append(version)
            if i + 1 < len(todo):
                crash_point("hub.replicate.backfilled")
        self.plan.retire_below_floor()
        self._tell_holding()
        return done

    def _tell_holding(self) -> None:
        """Pass the region store's `latest` pointer to `on_holding` (which publishes only changes)."""
        if self.on_holding is None:
            return
        try:
            pointer = json.loads(self.local.get(mf.latest_key(self.run)))
        except ObjectNotFound:
            return
        except ValueError as exc:
            log.warning("replicator.bad_latest", region=self.region, error=str(exc))
            return
        self.on_holding(int(pointer["version"]), str(pointer["sha256"]), int(pointer["anchor"]))

    # --- the daemon loop --------------------------------------------------------------------

    def serve(self, stop: threading.Event, *, once: bool = False) -> None:
        """Contend for the lease and replicate until `stop` is set (or after one pass with `once`)."""
        poll = self.config.hub.poll_interval_s
        try:
            while not stop.is_set():
                if self._hold():
                    try:
                        self.replicate_once(stop)
                    except LeaseLost as exc:
                        log.warning("replicator.lease_lost", region=self.region, error=str(exc))
                    except HubError as exc:
                        if not exc.retriable:
                            raise
                        log.warning("replicator.retry", region=self.region, error=str(exc))
                    if once:
                        return
                elif once:
                    raise LeaseLost(f"{self.region}: replicator lease is held by {self.lease.current()}")
                stop.wait(poll)
        finally:
            self.lease.release()
            self.close()

    def close(self) -> None:
        """Stop the threads of the region-local reader used to rebuild anchors (if one was started)."""
        self.copier.close()

    def _hold(self) -> bool:
        """Renew the lease we hold (at a third of its TTL), or try to take it; the gauge follows."""
        held = self._hold_lease()
        self.metrics.lease_held.labels(self.region).set(1.0 if held else 0.0)
        return held

    def _hold_lease(self) -> bool:
        if self.lease.held:
            try:
                self.copier.keep_lease()
                return True
            except LeaseLost as exc:
                log.warning("replicator.lease_lost", region=self.region, error=str(exc))
                return False
        if self.lease.acquire():
            self.copier.renewed = time.monotonic()
            return True
        return False
