"""Which versions a region's store still needs, in the order they are copied.

`PendingVersions` decides what the region's replicator (`replicator.py`) copies next; `copier.py`
copies it. The newest version is learned from the home store's `latest` and from `VersionHints` (the
retained policy announcement and the peers' replica announcements), so home is not needed. What is
pending: the holes an earlier replicator left below the region's `latest` (found once per process),
then every version after `latest` in order, never a jump past one, so that every version in the store
verifies against its parent. A LoRA adapter chain's base is copied first when the region lacks it.
A version collected from every store (`fleetrl hub gc` while the region was away) restarts the
region's chain at the oldest version home still holds, and the versions below it are retired once
the region's `latest` reaches it.
"""

from __future__ import annotations

import threading

from fleetrl.hub import manifest as mf
from fleetrl.hub.copier import VersionCopier
from fleetrl.hub.errors import IntegrityError, ObjectNotFound, StoreError
from fleetrl.hub.publisher import read_latest
from fleetrl.hub.rebuild import follows_chain
from fleetrl.hub.retention import gaps, retire_below, stored_versions
from fleetrl.log import get_logger

log = get_logger(__name__)
_ESTIMATE_MAX_VERSIONS = 48
"""A catch-up's log estimates both routes' bytes from the manifests up to this many versions (the manifest
cache holds 64, so the copy reads them again only past that)."""


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


class PendingVersions:
    """The versions the store of `copier.region` lacks, and where its chain starts."""

    def __init__(self, copier: VersionCopier, hints: VersionHints) -> None:
        self.copier, self.hints = copier, hints
        self.run, self.region = copier.run, copier.region
        self.holes: list[int] | None = None
        """Versions missing below the region's `latest` (None until this process has looked, once)."""
        self.floor: int | None = None
        """Where the region's chain starts again after versions were collected from every store."""

    def pending(self) -> list[int]:
        """Versions to copy, oldest first: the holes an earlier replicator left below the region's
        `latest` (found once per process), then every version after `latest` in order (or, into a
        region store without `latest`, from its oldest version or else the newest anchor). Never a jump
        past a version: a region keeps every version from where its chain starts, so each verifies."""
        newest = self.newest()
        if newest is None:
            return []
        local = self.copier.local
        have = read_latest(local, self.run)
        holes = self._holes_below(have)
        if have is None:
            held = stored_versions(local, self.run)
            start = held[0] if held else self.copier.manifest_anywhere(newest)[0].anchor
        else:
            start = have + 1
        if self.floor is not None:
            start = max(start, self.floor)
        todo = holes + list(range(start, newest + 1))
        return self._missing_base(todo[0]) + todo if todo else []

    def newest(self) -> int | None:
        """The newest version known: the home store's `latest`, or what the announcements said,
        whichever is newer; home being unreachable is logged, not fatal."""
        try:
            home_latest = read_latest(self.copier.home, self.run)
        except StoreError as exc:
            self.copier.home_answered(exc)
            home_latest = None
        else:
            self.copier.home_answered(None)
        known = [v for v in (home_latest, self.hints.newest()) if v is not None]
        return max(known) if known else None

    def copied(self, version: int) -> None:
        """`version` is in the region store now: no longer a hole."""
        if self.holes and version in self.holes:
            self.holes.remove(version)

    def _holes_below(self, have: int | None) -> list[int]:
        """Versions missing from the region store between its oldest and `latest` (an older replicator
        jumped ahead after a partition): looked for at this process's first pass, then those of them
        still unfilled. The run between a LoRA base and its adapter chain is not a hole (retention.gaps)."""
        if self.holes is None:
            local = self.copier.local
            held = stored_versions(local, self.run)
            top = min(have, held[-1]) if have is not None and held else None
            below = [v for v in held if top is not None and v <= top]
            self.holes = gaps(below, lambda v: self.copier.manifest(local, v)[0]) if below else []
            if self.holes:
                log.warning("replicator.holes_found", region=self.region, holes=_spans(self.holes),
                            count=len(self.holes), hint="filling them, oldest first, before newer versions")
        return list(self.holes)

    def _missing_base(self, start: int) -> list[int]:
        """[the base] when version `start` is a LoRA adapter on a base older than it that the region store
        lacks (a region joining mid-run starts from the adapter chain's anchor), else []."""
        try:
            base = self.copier.manifest_anywhere(start)[0].base
        except (StoreError, IntegrityError):
            return []  # unreadable now: its copy says why (or restarts the chain when it is in no store)
        if base is None or base >= start or self.copier.local.exists(mf.holder_key(self.run, base, self.region)):
            return []
        return [base]

    # --- a chain restarted after gc ---------------------------------------------------------

    def restart_chain(self, version: int, exc: ObjectNotFound) -> None:
        """`version` is in no store (collected at home by `fleetrl hub gc`): start the region's chain at
        the oldest version home still holds (an anchor: gc keeps whole chains); the versions below it
        are retired from the region store once its `latest` reaches it, so that the store is gapless."""
        newer = [v for v in stored_versions(self.copier.home, self.run) if v > version]
        if not newer:
            log.warning("replicator.version_gone", version=version, region=self.region, error=str(exc))
            return
        self.floor = newer[0]
        self.holes = [h for h in (self.holes or []) if h >= self.floor]
        log.warning("replicator.chain_restarted", region=self.region, gone=version, floor=self.floor,
                    reason=f"version {version} is in no store (collected by gc); the region's chain starts "
                           f"again at {self.floor}, and its versions below that are retired")

    def retire_below_floor(self) -> None:
        """Once the region's `latest` reached a restarted chain's floor, delete its versions below it."""
        copier = self.copier
        if self.floor is None or (read_latest(copier.local, self.run) or -1) < self.floor:
            return
        report = retire_below(copier.local, copier.local_hub().reader, self.run, self.floor,
                              copier.config.hub.gc_grace_s)
        for v in report.deleted_versions:  # peers must not look here for them any more
            try:
                copier.home.delete(mf.holder_key(self.run, v, self.region))
            except StoreError as exc:
                copier.home_answered(exc)
                break
        log.info("replicator.retired", region=self.region, floor=self.floor,
                 versions=_spans(report.deleted_versions))
        self.floor = None

    # --- the route of a catch-up ------------------------------------------------------------

    def log_route(self, todo: list[int]) -> None:
        """Say how a catch-up of several versions goes, and why: in order, each version from its cheapest
        holder. The bytes of the other route (the newest anchor whole, then what follows it) are logged
        beside; it would leave the versions before that anchor out of the region store, whose every
        version must verify, so it is never taken while those versions can still be copied."""
        if len(todo) > _ESTIMATE_MAX_VERSIONS:  # a manifest read each: not worth it for a long catch-up
            log.info("replicator.catch_up", region=self.region, versions=_spans(todo), count=len(todo),
                     route="in_order")
            return
        try:
            manifests = {v: self.copier.manifest_anywhere(v)[0] for v in todo}
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
            return self.copier.local.exists(mf.version_key(self.run, version))
        except StoreError:
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
