"""Retention: delete versions older than the window, and objects no retained version needs.

The window is the newest `hub.retention_versions` versions; every version back to the oldest anchor
any of them starts from is kept too, and the base version of every kept LoRA adapter version (its
full weights, however old), so each retained version stays materializable. A version *pinned* by an
unfinished evaluation (`<run>/pins/<N>`, written by the trainer when it schedules the evaluation and
removed when every eval prompt has returned, DESIGN.md §12; `<run>/pins/<N>-<holder>` for another holder,
such as a `fleetrl eval` request, so that each releases only its own pin) is kept with its chain, however
old. Manifests go first (oldest first), then holder markers, then objects: a reader never finds a manifest whose
objects are gone. Objects younger than `hub.gc_grace_s` stay even when unreferenced, because a
publisher may be uploading them before it creates its manifest.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

from fleetrl.crashpoints import crash_point
from fleetrl.hub import manifest as mf
from fleetrl.hub.publisher import read_latest
from fleetrl.hub.reader import Reader
from fleetrl.hub.stores import ObjectStore
from fleetrl.log import get_logger

log = get_logger(__name__)


@dataclass
class GcReport:
    kept_versions: list[int] = field(default_factory=list)
    deleted_versions: list[int] = field(default_factory=list)
    deleted_objects: list[str] = field(default_factory=list)
    freed_bytes: int = 0


def pin_key(run: str, version: int, holder: str | None = None) -> str:
    """The trainer's pin of `version` (`holder` None), or another holder's (`fleetrl eval`'s request)."""
    # (`-`, not `/`: a directory store cannot hold a file `<N>` and a folder `<N>/` side by side)
    return f"{run}/pins/{version:012d}" + ("" if holder is None else f"-{holder}")


def pin(store: ObjectStore, run: str, version: int, holder: str | None = None) -> None:
    """Keep `version` (and the chain it needs) through retention until `unpin` (of the same holder)."""
    store.put(pin_key(run, version, holder), b"")


def unpin(store: ObjectStore, run: str, version: int, holder: str | None = None) -> None:
    store.delete(pin_key(run, version, holder))


def pinned_versions(store: ObjectStore, run: str) -> list[int]:
    """Versions some holder pins (each once)."""
    prefix = f"{run}/pins/"
    heads = {i.key[len(prefix):].split("-", 1)[0] for i in store.scan(prefix)}
    return sorted(int(h) for h in heads if h.isdigit() and h.isascii())


def _holder_version(key: str, run: str) -> int:
    """N of `<run>/holders/<N>/<store>`."""
    return int(key[len(f"{run}/holders/"):].split("/", 1)[0])


def collect(store: ObjectStore, reader: Reader, run: str, retention: int, grace_s: float,
            *, dry_run: bool = False) -> GcReport:
    """Apply the retention window to `store`; with `dry_run`, only report what would go."""
    versions = stored_versions(store, run)
    if not versions:
        return GcReport()
    latest = read_latest(store, run)
    newest = max(versions[-1], latest if latest is not None else -1)
    pinned = set(pinned_versions(store, run))
    window = [v for v in versions if v > newest - retention or v in pinned]
    floor = min([reader.manifest(v).anchor for v in window] + [newest])
    return retire_below(store, reader, run, floor, grace_s, versions=versions, dry_run=dry_run)


def stored_versions(store: ObjectStore, run: str) -> list[int]:
    """The versions whose manifest `store` holds, oldest first."""
    prefix = f"{run}/versions/"
    return sorted(int(i.key[len(prefix):].split(".")[0]) for i in store.scan(prefix) if i.key.endswith(".json"))


def gaps(versions: list[int], manifest: Callable[[int], mf.Manifest]) -> list[int]:
    """Versions missing between a store's oldest and newest, but for the run between a LoRA run's base and
    its adapter chain: gc keeps an adapter's base however old, and a region joining mid-run copies the
    base and the chain from its newest anchor. A missing run is such when the version right after it is an
    anchor of adapters on a base that is the only version before the run."""
    held = set(versions)
    out: list[int] = []
    v = versions[0] if versions else 0
    while versions and v < versions[-1]:
        if v in held:
            v += 1
            continue
        end = v
        while end not in held:
            end += 1
        after = manifest(end)
        before = {u for u in versions if u < v}
        if not (after.is_anchor and after.base is not None and before == {after.base}):
            out.extend(range(v, end))
        v = end
    return out


def retire_below(store: ObjectStore, reader: Reader, run: str, floor: int, grace_s: float, *,
                 versions: list[int] | None = None, dry_run: bool = False) -> GcReport:
    """Delete every version below `floor` (an anchor, or the start of the store's chain) but the LoRA
    bases that versions from `floor` on apply to, and the objects no kept version needs: manifests
    oldest first, then holder references, then objects, so that a reader never finds a manifest whose
    objects are gone."""
    versions = stored_versions(store, run) if versions is None else versions
    report = GcReport()
    chains = [v for v in versions if v >= floor]
    # A LoRA run's adapter versions apply to a full-weights base published once, long before them: kept.
    bases = {b for v in chains if (b := reader.manifest(v).base) is not None}
    kept = set(chains) | (bases & set(versions))
    report.kept_versions = sorted(kept)
    report.deleted_versions = [v for v in versions if v not in kept]
    needed = {obj for v in report.kept_versions for obj in reader.manifest(v).objects}
    now = time.time()
    doomed = [i for i in store.scan(f"{run}/objects/")
              if i.key.rsplit("/", 1)[-1] not in needed and now - i.modified >= grace_s]
    report.deleted_objects = [i.key for i in doomed]
    report.freed_bytes = sum(i.size for i in doomed)
    if dry_run:
        return report
    for v in report.deleted_versions:
        store.delete(mf.version_key(run, v))
        crash_point("hub.gc.manifest_deleted")
    # Every holder reference below the floor, not only those of the manifests deleted now: a pass that
    # was killed after deleting manifests leaves their references for this one.
    for info in store.scan(f"{run}/holders/"):
        held = _holder_version(info.key, run)
        if held < floor and held not in bases:
            store.delete(info.key)
            crash_point("hub.gc.holder_deleted")
    for info in doomed:
        store.delete(info.key)
        crash_point("hub.gc.object_deleted")
    log.info("hub.gc", store=store.name, floor=floor, bases=sorted(bases),
             deleted_versions=len(report.deleted_versions), deleted_objects=len(doomed), freed_bytes=report.freed_bytes)
    return report
