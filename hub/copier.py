"""How a version is copied into a region's store: from its nearest holder, verified, then referenced.

`VersionCopier` does the copying for the region's replicator (`replicator.py`, which decides when,
with `pending.py` deciding which versions). For one version it ranks the stores that hold it by this
region's link costs (`sources`: the holder references listed at home, the peers heard to hold it,
home last), reads and verifies its signed manifest (cached: every store holds the same bytes), copies
every object the region lacks, each checked against its sha256 before it is written (an anchor's
dense objects are rebuilt here from the region's own chain when it can, see rebuild.py), writes the
manifest, the holder reference in the region store and then in the home store, and moves the region's
`latest`. Home holder references that could not be written (home unreachable) are owed and written
once home answers. Every write happens under the region's replicator lease, renewed as the copy goes.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import time
from collections.abc import Callable, Mapping

import numpy as np

from fleetrl.config import FleetConfig
from fleetrl.crashpoints import crash_point
from fleetrl.hub import manifest as mf
from fleetrl.hub.errors import HubError, IntegrityError, LeaseLost, ObjectExists, ObjectNotFound, StoreError
from fleetrl.hub.hub import Hub
from fleetrl.hub.lease import Lease
from fleetrl.hub.metrics import ReplicatorMetrics
from fleetrl.hub.publisher import read_latest
from fleetrl.hub.rebuild import dense_objects, follows_chain
from fleetrl.hub.signing import Keys
from fleetrl.hub.stores import ObjectStore
from fleetrl.hub.tensors import to_words
from fleetrl.log import get_logger

log = get_logger(__name__)
Progress = Callable[[int], None]
HeardHolders = Callable[[int], set[str]]
"""Regions heard (on the control plane) to hold a version: `VersionHints.holders`."""


class VersionCopier:
    """Copies versions into the store of `region` from the stores that hold them."""

    def __init__(self, config: FleetConfig, region: str, stores: Mapping[str, ObjectStore], keys: Keys,
                 lease: Lease, metrics: ReplicatorMetrics, heard_holders: HeardHolders) -> None:
        self.config, self.run, self.region = config, config.run, region
        self.costs = config.region(region).link_costs
        self.stores = stores
        self.local, self.home = stores[region], stores["home"]
        self.keys, self.lease, self.metrics = keys, lease, metrics
        self.heard_holders = heard_holders
        self.progress: Progress | None = None
        self.renewed = 0.0
        """When the lease was last renewed or taken (monotonic seconds)."""
        self._manifests: dict[int, tuple[mf.Manifest, bytes]] = {}
        self._hub: Hub | None = None
        self.rebuilt_bytes = 0
        """Bytes of dense anchor objects rebuilt in the region instead of copied (see rebuild.py)."""
        self.owed_home: set[int] = set()
        """Versions whose holder reference could not be written into the home store (unreachable)."""
        self._owed_found = False
        """Whether this process has looked for references an earlier one still owed home (`find_owed`)."""
        self._home_down = False

    # --- where from -------------------------------------------------------------------------

    def sources(self, version: int) -> list[ObjectStore]:
        """Stores holding `version`, nearest first by this region's link costs; home always last resort.

        Holders are the peer references listed in the home store and the peers whose announcements
        say they hold it; with home unreachable, also every peer whose own store carries its holder
        reference for the version."""
        prefix = mf.holders_prefix(self.run, version)
        peers = [n for n in self.stores if n not in ("home", self.region)]
        try:
            names = {i.key[len(prefix):] for i in self.home.scan(prefix)}
        except StoreError as exc:
            self.home_answered(exc)
            names = {n for n in peers if self._holds(n, version)}
        names |= self.heard_holders(version) | {"home"}
        names = {n for n in names if n in self.stores and n != self.region}
        ranked = sorted(names, key=lambda n: (self.costs.get(n, math.inf if n != "home" else 1e300), n))
        return [self.stores[n] for n in ranked]

    def _holds(self, name: str, version: int) -> bool:
        """Whether store `name` carries its own holder reference of `version` (False if unreachable)."""
        try:
            return self.stores[name].exists(mf.holder_key(self.run, version, name))
        except StoreError as exc:
            log.warning("replicator.peer_unreachable", region=self.region, peer=name, error=str(exc))
            return False

    def manifest(self, store: ObjectStore, version: int) -> tuple[mf.Manifest, bytes]:
        """A verified manifest; cached, since every store holds the same signed bytes for a version."""
        if version not in self._manifests:
            key = mf.version_key(self.run, version)
            data = store.get(key)
            if len(self._manifests) > 64:
                self._manifests.clear()
            self._manifests[version] = (
                mf.load_signed(data, self.keys, store.where(key), run=self.run, version=version), data)
        return self._manifests[version]

    def manifest_anywhere(self, version: int) -> tuple[mf.Manifest, bytes]:
        """The verified manifest of `version` from the nearest store that has it."""
        errors: list[str] = []
        for source in self.sources(version):
            try:
                return self.manifest(source, version)
            except (StoreError, IntegrityError) as exc:
                errors.append(f"{source.name}: {exc}")
        raise StoreError(f"no store could supply the manifest of version {version} to {self.region}: "
                         f"{'; '.join(errors)}")

    # --- the copy ---------------------------------------------------------------------------

    def copy_version(self, version: int) -> int:
        """Copy one version's manifest and missing objects; returns the object bytes copied."""
        errors: list[str] = []
        unreachable = False
        started = time.monotonic()
        for source in self.sources(version):
            try:
                copied = self._copy_from(source, version)
            except (StoreError, IntegrityError) as exc:
                if isinstance(exc, ObjectExists) or (isinstance(exc, StoreError) and not exc.retriable):
                    raise
                unreachable |= not isinstance(exc, (ObjectNotFound, IntegrityError))
                errors.append(f"{source.name}: {exc}")
                continue
            log.info("replicator.copied", version=version, region=self.region, source=source.name, bytes=copied)
            self.metrics.versions_copied.labels(self.region).inc()
            self.metrics.copied_bytes.labels(self.region).inc(copied)
            self.metrics.copy_seconds.labels(self.region).observe(time.monotonic() - started)
            self.metrics.version.labels(self.region).set(max(version, read_latest(self.local, self.run) or -1))
            return copied
        message = f"no store could supply version {version} to {self.region}: {'; '.join(errors)}"
        # A store that did not answer may hold it: try again later rather than skip the version.
        raise StoreError(message) if unreachable else ObjectNotFound(message)

    def _copy_from(self, source: ObjectStore, version: int) -> int:
        manifest, raw = self.manifest(source, version)
        missing = {obj for obj in manifest.objects if not self.local.exists(mf.object_key(self.run, obj))}
        copied = 0
        if manifest.is_anchor and follows_chain(manifest) and missing - manifest.delta_objects():
            # Deltas first: the dense objects are then rebuilt here rather than copied over the WAN.
            for obj in sorted(missing & manifest.delta_objects()):
                copied += self._copy_object(source, obj, manifest.objects[obj], version)
            missing -= manifest.delta_objects()
            missing -= self._rebuild(manifest, missing)
        for obj in sorted(missing):
            copied += self._copy_object(source, obj, manifest.objects[obj], version)
        crash_point("hub.replicate.objects_copied")
        with contextlib.suppress(ObjectExists):
            self.local.create(mf.version_key(self.run, version), raw)
        crash_point("hub.replicate.manifest_copied")
        self.keep_lease()
        self.local.put(mf.holder_key(self.run, version, self.region), b"")
        crash_point("hub.replicate.holder_written")
        self.owed_home.add(version)
        self.pay_home()
        crash_point("hub.replicate.home_holder_written")
        if (read_latest(self.local, self.run) or -1) < version:
            pointer = {"version": version, "manifest": mf.version_key(self.run, version),
                       "anchor": manifest.anchor, "sha256": hashlib.sha256(raw).hexdigest(),
                       "published_at": manifest.published_at}
            self.local.put(mf.latest_key(self.run), json.dumps(pointer).encode())
            crash_point("hub.replicate.latest_moved")
        return copied

    def _copy_object(self, source: ObjectStore, obj: str, size: int, version: int) -> int:
        """One object across the WAN, checked against its sha256 before it is written."""
        key = mf.object_key(self.run, obj)
        data = source.get(key)
        if len(data) != size or hashlib.sha256(data).hexdigest() != obj:
            raise IntegrityError(f"{source.where(key)}: object does not match its sha256 (version {version})")
        with contextlib.suppress(ObjectExists):  # a previous lease holder got there first: same bytes
            self.local.create(key, data)
        if self.progress is not None:
            self.progress(len(data))
        self.keep_lease()
        return len(data)

    def _rebuild(self, manifest: mf.Manifest, wanted: set[str]) -> set[str]:
        """Rebuild the anchor's dense objects in `wanted` from the version before it, which this
        region holds; returns those written (each checked against its sha256 in the manifest)."""
        version = manifest.version
        if not self.local.exists(mf.holder_key(self.run, version - 1, self.region)):
            return set()  # joined after N-1: nothing to build from
        self.keep_lease()
        try:
            words = self._materialize_here(manifest)
        except HubError as exc:
            log.warning("replicator.rebuild_failed", version=version, region=self.region, error=str(exc))
            return set()
        built: set[str] = set()
        hub = self.local_hub()
        for obj, data in dense_objects(manifest, words, wanted, self.config.hub.zstd_level, hub.pool):
            if data is None:
                log.warning("replicator.rebuild_mismatch", version=version, region=self.region, object=obj,
                            hint="the publisher's zstd build or hub.zstd_level differs; copying it instead")
                continue
            with contextlib.suppress(ObjectExists):
                self.local.create(mf.object_key(self.run, obj), data)
            self.rebuilt_bytes += len(data)
            self.metrics.rebuilt_bytes.labels(self.region).inc(len(data))
            built.add(obj)
            self.keep_lease()
        log.info("replicator.rebuilt", version=version, region=self.region, objects=len(built),
                 bytes=sum(manifest.objects[o] for o in built), mismatched=len(wanted - built))
        return built

    def _materialize_here(self, manifest: mf.Manifest) -> dict[str, np.ndarray]:
        """Anchor `manifest`'s tensors as words, from this region's store only: its parent from the
        verified chain, then the anchor's delta (its objects are copied already), every word checked."""
        hub = self.local_hub()
        hub.reader.remember(manifest)
        state = hub.materialize(manifest.version - 1)
        state = hub.materialize(manifest.version, into=state, have_version=manifest.version - 1)
        return {name: to_words(tensor) for name, tensor in state.items()}

    def local_hub(self) -> Hub:
        """A hub reading this region's store only (anchor rebuilds, retiring versions)."""
        if self._hub is None:
            self._hub = Hub(self.config, store=self.region, stores=self.stores)
        return self._hub

    def close(self) -> None:
        """Stop the threads of the region-local reader used to rebuild anchors (if one was started)."""
        if self._hub is not None:
            self._hub.close()
            self._hub = None

    # --- holder references owed home -------------------------------------------------------

    def find_owed(self) -> None:
        """Once per process: the versions the region store holds (its own holder references) that the
        home store does not list for this region. An earlier replicator killed while home was
        unreachable kept them owed in memory only; its region `latest` had moved on, so no copy of
        those versions will write them again."""
        if self._owed_found:
            return
        prefix = f"{self.run}/holders/"

        def mine(store: ObjectStore) -> set[int]:
            return {int(i.key[len(prefix):].split("/", 1)[0]) for i in store.scan(prefix)
                    if i.key.rsplit("/", 1)[-1] == self.region}

        try:
            owed = mine(self.local) - mine(self.home)
        except StoreError as exc:
            self.home_answered(exc)
            return
        self._owed_found = True
        if owed:
            log.info("replicator.owed_found", region=self.region, versions=sorted(owed)[:20], count=len(owed))
        self.owed_home |= owed

    def pay_home(self) -> None:
        """Write the holder references the home store still lacks (it was unreachable); kept for later
        while it still is."""
        for version in sorted(self.owed_home):
            try:
                self.home.put(mf.holder_key(self.run, version, self.region), b"")
            except StoreError as exc:
                self.home_answered(exc)
                return
            self.owed_home.discard(version)

    def home_answered(self, error: StoreError | None) -> None:
        """Log when the home store stops answering and when it answers again (not every poll)."""
        if error is not None and not self._home_down:
            log.warning("replicator.home_unreachable", region=self.region, owed=len(self.owed_home),
                        error=str(error))
        elif error is None and self._home_down:
            log.info("replicator.home_reachable", region=self.region, owed=len(self.owed_home))
        self._home_down = error is not None

    # --- the lease --------------------------------------------------------------------------

    def keep_lease(self) -> None:
        """Renew at a third of the TTL; a replicator that lost its lease must stop writing."""
        if self.lease._generation is None:
            return  # used without a lease (tests, `--once` after acquiring)
        if time.monotonic() - self.renewed >= self.config.hub.lease_ttl_s / 3:
            self.lease.renew()
            self.renewed = time.monotonic()
        if not self.lease.held:
            raise LeaseLost(f"lease of {self.region} expired while copying")
