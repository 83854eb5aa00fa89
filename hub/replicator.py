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

An anchor's dense objects are not copied when the region holds the version before it: only the
anchor's delta crosses the WAN, and the dense objects are rebuilt here from the region's own chain
and kept only if byte for byte the published ones (see rebuild.py); any other is copied. So a region
that follows the chain receives only deltas over the WAN, one copy per version.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import threading
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
from fleetrl.hub.retention import retire_below, stored_versions
from fleetrl.hub.signing import Keys, load_keys
from fleetrl.hub.stores import ObjectStore, open_store
from fleetrl.hub.tensors import to_words
from fleetrl.log import get_logger

log = get_logger(__name__)
Progress = Callable[[int], None]
_ESTIMATE_MAX_VERSIONS = 48
"""A catch-up's log estimates both routes' bytes from the manifests up to this many versions (the manifest
cache holds 64, so the copy reads them again only past that)."""
Holding = Callable[[int, str, int], None]
"""Told (version, manifest sha256, anchor) of the newest version the region store holds, after each pass
of the lease holder: the region agent's daemon announces it on the control plane (the hub knows no MQTT)."""


class VersionHints:
    """Newest versions heard of outside the home store (thread-safe): `policy` from the trainer's
    announcement (home holds it), and each peer region's from its replica announcement (its store
    holds it). Only ever moves forward."""

    POLICY = "policy"

    def __init__(self) -> None:
        self._heard: dict[str, int] = {}
        self._lock = threading.Lock()

    def hear(self, source: str, version: int) -> None:
        """`source` (POLICY or a region name) holds `version`."""
        with self._lock:
            if version > self._heard.get(source, -1):
                self._heard[source] = version

    def newest(self) -> int | None:
        with self._lock:
            return max(self._heard.values(), default=None)

    def holders(self, version: int) -> set[str]:
        """Regions whose announced newest version is at least `version` (they likely hold it)."""
        with self._lock:
            return {s for s, v in self._heard.items() if s != self.POLICY and v >= version}


class Replicator:
    """Keeps the store of `region` up to date with the newest version, from home or from peers."""

    def __init__(self, config: FleetConfig, region: str, stores: Mapping[str, ObjectStore] | None = None,
                 holder: str | None = None, keys: Keys | None = None,
                 metrics: ReplicatorMetrics | None = None, hints: VersionHints | None = None) -> None:
        self.config, self.run, self.region = config, config.run, region
        self.costs = config.region(region).link_costs
        given = dict(stores or {})
        self.stores = {name: given.get(name) or open_store(name, cfg, threads=config.hub.threads)
                       for name, cfg in config.stores().items()}
        self.local, self.home = self.stores[region], self.stores["home"]
        self.keys = keys or load_keys(config.hub.signing)
        self.lease = Lease(self.local, self.run, "replicator", config.hub.lease_ttl_s, holder)
        self.progress: Progress | None = None
        self.on_holding: Holding | None = None
        self._renewed = 0.0
        self._manifests: dict[int, tuple[mf.Manifest, bytes]] = {}
        self._hub: Hub | None = None
        self.rebuilt_bytes = 0
        """Bytes of dense anchor objects rebuilt in the region instead of copied (see rebuild.py)."""
        self.metrics = metrics or ReplicatorMetrics()
        self.hints = hints or VersionHints()
        self._owed_home: set[int] = set()
        """Versions whose holder reference could not be written into the home store (unreachable)."""
        self._owed_found = False
        """Whether this process has looked for references an earlier one still owed home (`_find_owed`)."""
        self._home_down = False
        self._holes: list[int] | None = None
        """Versions missing below the region's `latest` (None until this process has looked, once)."""
        self._floor: int | None = None
        """Where the region's chain starts again after versions were collected from every store."""

    # --- one pass ---------------------------------------------------------------------------

    def pending(self) -> list[int]:
        """Versions to copy, oldest first: the holes an earlier replicator left below the region's
        `latest` (found once per process), then every version after `latest` in order (or, into a
        region store without `latest`, from its oldest version or else the newest anchor). Never a jump
        past a version: a region keeps every version from where its chain starts, so each verifies."""
        newest = self.newest()
        if newest is None:
            return []
        have = read_latest(self.local, self.run)
        holes = self._holes_below(have)
        if have is None:
            held = stored_versions(self.local, self.run)
            start = held[0] if held else self._manifest_anywhere(newest)[0].anchor
        else:
            start = have + 1
        if self._floor is not None:
            start = max(start, self._floor)
        return holes + list(range(start, newest + 1))

    def _holes_below(self, have: int | None) -> list[int]:
        """Versions missing from the region store between its oldest and `latest` (an older replicator
        jumped ahead after a partition): looked for at this process's first pass, then those of them
        still unfilled."""
        if self._holes is None:
            held = stored_versions(self.local, self.run)
            top = min(have, held[-1]) if have is not None and held else None
            self._holes = sorted(set(range(held[0], top + 1)) - set(held)) if top is not None else []
            if self._holes:
                log.warning("replicator.holes_found", region=self.region, holes=_spans(self._holes),
                            count=len(self._holes), hint="filling them, oldest first, before newer versions")
        return list(self._holes)

    def newest(self) -> int | None:
        """The newest version known: the home store's `latest`, or what the announcements said,
        whichever is newer; home being unreachable is logged, not fatal."""
        try:
            home_latest = read_latest(self.home, self.run)
        except StoreError as exc:
            self._home_answered(exc)
            home_latest = None
        else:
            self._home_answered(None)
        known = [v for v in (home_latest, self.hints.newest()) if v is not None]
        return max(known) if known else None

    def _manifest_anywhere(self, version: int) -> tuple[mf.Manifest, bytes]:
        """The verified manifest of `version` from the nearest store that has it."""
        errors: list[str] = []
        for source in self.sources(version):
            try:
                return self._manifest(source, version)
            except (StoreError, IntegrityError) as exc:
                errors.append(f"{source.name}: {exc}")
        raise StoreError(f"no store could supply the manifest of version {version} to {self.region}: "
                         f"{'; '.join(errors)}")

    def replicate_once(self, stop: threading.Event | None = None) -> list[int]:
        """Copy every pending version (the caller holds the lease); returns the versions copied.

        With `stop` set, the version being copied is finished and the rest left for the next holder.
        """
        done: list[int] = []
        self._find_owed()
        self._pay_home()
        todo = self.pending()
        if len(todo) > 1:
            self._log_route(todo)
        for i, version in enumerate(todo):
            if stop is not None and stop.is_set():
                break
            self._keep_lease()
            try:
                self.copy_version(version)
            except ObjectNotFound as exc:
                # In no store any more (gc at home ran while the region was away): the region's chain
                # starts again at the oldest version home holds, and what is below it goes.
                self._restart_chain(version, exc)
                break
            if self._holes and version in self._holes:
                self._holes.remove(version)
            done.append(version)
            if i + 1 < len(todo):
                crash_point("hub.replicate.backfilled")
        self._retire_below_floor()
        self._tell_holding()
        return done

    def _log_route(self, todo: list[int]) -> None:
        """Say how a catch-up of several versions goes, and why: in order, each version from its cheapest
        holder. The bytes of the other route (the newest anchor whole, then what follows it) are logged
        beside; it would leave the versions before that anchor out of the region store, whose every
        version must verify, so it is never taken while those versions can still be copied."""
        if len(todo) > _ESTIMATE_MAX_VERSIONS:  # a manifest read each: not worth it for a long catch-up
            log.info("replicator.catch_up", region=self.region, versions=_spans(todo), count=len(todo),
                     route="in_order")
            return
        try:
            manifests = {v: self._manifest_anywhere(v)[0] for v in todo}
        except (StoreError, IntegrityError) as exc:
            log.info("replicator.catch_up", region=self.region, versions=_spans(todo), count=len(todo),
                     route="in_order", estimate_error=str(exc))
            return
        in_order = sum(_wan_bytes(m, rebuilt=v > todo[0] or self._holds_here(v - 1)) for v, m in manifests.items())
        anchor = manifests[todo[-1]].anchor
        skipped = [v for v in todo if v < anchor]
        jump = sum(_wan_bytes(m, rebuilt=v > anchor) for v, m in manifests.items() if v >= anchor)
        log.info("replicator.catch_up", region=self.region, versions=_spans(todo), count=len(todo),
                 route="in_order", bytes_in_order=in_order, bytes_from_anchor=jump if skipped else None,
                 anchor=anchor, reason=(f"starting at anchor {anchor} would leave {_spans(skipped)} out of the "
                                        "region store (each version there must verify)") if skipped
                 else "no newer anchor to start from")

    def _holds_here(self, version: int) -> bool:
        try:
            return self.local.exists(mf.version_key(self.run, version))
        except StoreError:
            return False

    def _restart_chain(self, version: int, exc: ObjectNotFound) -> None:
        """`version` is in no store (collected at home by `fleetrl hub gc`): start the region's chain at
        the oldest version home still holds (an anchor: gc keeps whole chains); the versions below it
        are retired from the region store once its `latest` reaches it, so that the store is gapless."""
        newer = [v for v in stored_versions(self.home, self.run) if v > version]
        if not newer:
            log.warning("replicator.version_gone", version=version, region=self.region, error=str(exc))
            return
        self._floor = newer[0]
        self._holes = [h for h in (self._holes or []) if h >= self._floor]
        log.warning("replicator.chain_restarted", region=self.region, gone=version, floor=self._floor,
                    reason=f"version {version} is in no store (collected by gc); the region's chain starts "
                           f"again at {self._floor}, and its versions below that are retired")

    def _retire_below_floor(self) -> None:
        """Once the region's `latest` reached a restarted chain's floor, delete its versions below it."""
        if self._floor is None or (read_latest(self.local, self.run) or -1) < self._floor:
            return
        report = retire_below(self.local, self._local_hub().reader, self.run, self._floor,
                              self.config.hub.gc_grace_s)
        for v in report.deleted_versions:  # peers must not look here for them any more
            try:
                self.home.delete(mf.holder_key(self.run, v, self.region))
            except StoreError as exc:
                self._home_answered(exc)
                break
        log.info("replicator.retired", region=self.region, floor=self._floor,
                 versions=_spans(report.deleted_versions))
        self._floor = None

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
            self._home_answered(exc)
            names = {n for n in peers if self._holds(n, version)}
        names |= self.hints.holders(version) | {"home"}
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

    def _manifest(self, store: ObjectStore, version: int) -> tuple[mf.Manifest, bytes]:
        """A verified manifest; cached, since every store holds the same signed bytes for a version."""
        if version not in self._manifests:
            key = mf.version_key(self.run, version)
            data = store.get(key)
            if len(self._manifests) > 64:
                self._manifests.clear()
            self._manifests[version] = (
                mf.load_signed(data, self.keys, store.where(key), run=self.run, version=version), data)
        return self._manifests[version]

    def _copy_from(self, source: ObjectStore, version: int) -> int:
        manifest, raw = self._manifest(source, version)
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
        self._keep_lease()
        self.local.put(mf.holder_key(self.run, version, self.region), b"")
        crash_point("hub.replicate.holder_written")
        self._owed_home.add(version)
        self._pay_home()
        crash_point("hub.replicate.home_holder_written")
        if (read_latest(self.local, self.run) or -1) < version:
            pointer = {"version": version, "manifest": mf.version_key(self.run, version),
                       "anchor": manifest.anchor, "sha256": hashlib.sha256(raw).hexdigest(),
                       "published_at": manifest.published_at}
            self.local.put(mf.latest_key(self.run), json.dumps(pointer).encode())
            crash_point("hub.replicate.latest_moved")
        return copied

    def _find_owed(self) -> None:
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
            self._home_answered(exc)
            return
        self._owed_found = True
        if owed:
            log.info("replicator.owed_found", region=self.region, versions=sorted(owed)[:20], count=len(owed))
        self._owed_home |= owed

    def _pay_home(self) -> None:
        """Write the holder references the home store still lacks (it was unreachable); kept for later
        while it still is."""
        for version in sorted(self._owed_home):
            try:
                self.home.put(mf.holder_key(self.run, version, self.region), b"")
            except StoreError as exc:
                self._home_answered(exc)
                return
            self._owed_home.discard(version)

    def _home_answered(self, error: StoreError | None) -> None:
        """Log when the home store stops answering and when it answers again (not every poll)."""
        if error is not None and not self._home_down:
            log.warning("replicator.home_unreachable", region=self.region, owed=len(self._owed_home),
                        error=str(error))
        elif error is None and self._home_down:
            log.info("replicator.home_reachable", region=self.region, owed=len(self._owed_home))
        self._home_down = error is not None

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
        self._keep_lease()
        return len(data)

    def _rebuild(self, manifest: mf.Manifest, wanted: set[str]) -> set[str]:
        """Rebuild the anchor's dense objects in `wanted` from the version before it, which this
        region holds; returns those written (each checked against its sha256 in the manifest)."""
        version = manifest.version
        if not self.local.exists(mf.holder_key(self.run, version - 1, self.region)):
            return set()  # joined after N-1: nothing to build from
        self._keep_lease()
        try:
            words = self._materialize_here(manifest)
        except HubError as exc:
            log.warning("replicator.rebuild_failed", version=version, region=self.region, error=str(exc))
            return set()
        built: set[str] = set()
        hub = self._local_hub()
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
            self._keep_lease()
        log.info("replicator.rebuilt", version=version, region=self.region, objects=len(built),
                 bytes=sum(manifest.objects[o] for o in built), mismatched=len(wanted - built))
        return built

    def _materialize_here(self, manifest: mf.Manifest) -> dict[str, np.ndarray]:
        """Anchor `manifest`'s tensors as words, from this region's store only: its parent from the
        verified chain, then the anchor's delta (its objects are copied already), every word checked."""
        hub = self._local_hub()
        hub.reader.remember(manifest)
        state = hub.materialize(manifest.version - 1)
        state = hub.materialize(manifest.version, into=state, have_version=manifest.version - 1)
        return {name: to_words(tensor) for name, tensor in state.items()}

    def _local_hub(self) -> Hub:
        if self._hub is None:
            self._hub = Hub(self.config, store=self.region, stores=self.stores)
        return self._hub

    def _keep_lease(self) -> None:
        """Renew at a third of the TTL; a replicator that lost its lease must stop writing."""
        if self.lease._generation is None:
            return  # used without a lease (tests, `--once` after acquiring)
        if time.monotonic() - self._renewed >= self.config.hub.lease_ttl_s / 3:
            self.lease.renew()
            self._renewed = time.monotonic()
        if not self.lease.held:
            raise LeaseLost(f"lease of {self.region} expired while copying")

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
        if self._hub is not None:
            self._hub.close()
            self._hub = None

    def _hold(self) -> bool:
        """Renew the lease we hold (at a third of its TTL), or try to take it; the gauge follows."""
        held = self._hold_lease()
        self.metrics.lease_held.labels(self.region).set(1.0 if held else 0.0)
        return held

    def _hold_lease(self) -> bool:
        if self.lease.held:
            try:
                self._keep_lease()
                return True
            except LeaseLost as exc:
                log.warning("replicator.lease_lost", region=self.region, error=str(exc))
                return False
        if self.lease.acquire():
            self._renewed = time.monotonic()
            return True
        return False


def _wan_bytes(manifest: mf.Manifest, *, rebuilt: bool) -> int:
    """Bytes a copy of `manifest`'s version crosses between stores: its delta objects alone for an anchor
    rebuilt in the region from the version before (`rebuilt`, see rebuild.py), else all its objects."""
    objects = manifest.delta_objects() if rebuilt and follows_chain(manifest) else set(manifest.objects)
    return sum(manifest.objects[o] for o in objects)


def _spans(versions: list[int]) -> str:
    """[1, 2, 3, 7] -> "1-3,7": version lists in logs stay one short field."""
    out: list[list[int]] = []
    for v in sorted(versions):
        if out and out[-1][1] == v - 1:
            out[-1][1] = v
        else:
            out.append([v, v])
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in out)
