"""The parent of the next version, for a publisher that does not hold it in memory (DESIGN.md §5).

Any process can publish: a fresh `fleetrl hub publish`, a restarted trainer, or a second publisher
after a `VersionConflict` reads the store's newest version, materializes it from its anchor and
chain, checks every tensor's sha256 against the signed manifest, and then deltas against it exactly
as a long-lived publisher would. A newest version that cannot be read or does not verify is not a
parent: the publisher writes an anchor instead and says why (`PublishedVersion.anchor_reason`).

`newest` also rolls forward over a version whose manifest is in the store but whose `latest`
pointer was never written (a publisher killed between the two writes): that version is complete
(objects are uploaded before the manifest), so the next one builds on it instead of colliding
with it forever.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from fleetrl.hub import manifest as mf
from fleetrl.hub.errors import HubError, ObjectNotFound
from fleetrl.hub.reader import Reader, empty_words
from fleetrl.log import get_logger

log = get_logger(__name__)
MAX_ROLL_FORWARD = 64
"""Versions past `latest` looked at before giving up (each costs one existence check)."""


@dataclass(frozen=True)
class StoredParent:
    """A verified version read back from the store: its manifest and every tensor's words."""

    manifest: mf.Manifest
    words: dict[str, np.ndarray]


def newest(reader: Reader, latest: int | None) -> int | None:
    """The newest complete version: `latest`, or a later one whose manifest verifies (a publisher
    died before moving `latest`); its home holder marker is written again on the way."""
    store, run = reader.store, reader.run
    nxt = 0 if latest is None else latest + 1
    for _ in range(MAX_ROLL_FORWARD):
        key = mf.version_key(run, nxt)
        if not store.exists(key):
            break
        try:
            reader.manifest(nxt)
        except HubError as exc:  # not a version we can build on: publishing over it will conflict
            log.warning("hub.orphan_manifest", key=store.where(key), error=str(exc))
            break
        store.put(mf.holder_key(run, nxt, store.name), b"")
        log.warning("hub.rolled_forward", version=nxt, latest=latest, store=store.name,
                    reason="manifest written but latest not moved (publisher killed in between)")
        latest, nxt = nxt, nxt + 1
    return latest


def read_parent(reader: Reader, version: int) -> StoredParent:
    """Materialize `version` from its anchor and chain into private arrays and check every tensor's
    sha256 against the signed manifest. Raises a HubError naming what is wrong."""
    try:
        manifest = reader.manifest(version)
    except ObjectNotFound as exc:
        raise HubError(f"latest version {version} has no manifest: {exc}") from exc
    entries = {t.name: t for t in manifest.tensors}
    steps, _ = reader.plan(version, None)
    work = {n: empty_words(e) for n, e in entries.items()}
    reader.apply(steps, work)
    reader.verify(version, work, set(work))
    return StoredParent(manifest, work)
