"""A lease held through conditional creates in an object store: who runs a region's replicator.

Records are `<run>/lease/<name>/<generation:012d>` JSON documents `{holder, expires_at, generation}`;
the highest generation is the current one. Taking or renewing the lease is creating the next
generation with a conditional create, so of two contenders exactly one wins, on S3 (`IfNoneMatch`)
and on a directory alike, with no compare-and-swap on a mutable key. A lease whose `expires_at` has
passed may be taken by anyone (stealing after a holder died); its holder renews it at a third of
the TTL and stops acting as soon as a renewal fails or its own deadline passes. Clocks of
contenders are assumed to agree to well within the TTL.
"""

from __future__ import annotations

import contextlib
import json
import time
from dataclasses import dataclass

from fleetrl.hub.errors import HubError, LeaseLost, ObjectExists, ObjectNotFound
from fleetrl.hub.stores import ObjectStore, unique_id
from fleetrl.log import get_logger

log = get_logger(__name__)


@dataclass(frozen=True)
class LeaseRecord:
    generation: int
    holder: str
    expires_at: float


class Lease:
    """One contender for the lease `name` in `store`."""

    def __init__(self, store: ObjectStore, run: str, name: str, ttl_s: float, holder: str | None = None) -> None:
        self.store, self.ttl_s = store, ttl_s
        self.prefix = f"{run}/lease/{name}/"
        self.holder = holder or unique_id()
        self._generation: int | None = None
        self._deadline = 0.0  # monotonic: past it we no longer trust that we hold the lease

    def _key(self, generation: int) -> str:
        return f"{self.prefix}{generation:012d}"

    def current(self) -> LeaseRecord | None:
        """The newest record, or None when nobody ever held the lease."""
        keys = [i.key for i in self.store.scan(self.prefix) if i.key[len(self.prefix):].isdigit()]
        for key in reversed(keys):
            try:
                doc = json.loads(self.store.get(key))
                return LeaseRecord(int(doc["generation"]), str(doc["holder"]), float(doc["expires_at"]))
            except ObjectNotFound:
                continue  # cleaned up between listing and reading: an older one
            except (ValueError, KeyError, TypeError) as exc:
                raise HubError(f"{self.store.where(key)}: not a lease record") from exc
        return None

    @property
    def held(self) -> bool:
        return self._generation is not None and time.monotonic() < self._deadline

    def acquire(self) -> bool:
        """Take the lease if free or expired, or renew it if ours; False when someone else holds it."""
        started = time.monotonic()
        cur = self.current()
        now = time.time()
        if cur is not None:
            mine = cur.holder == self.holder and cur.generation == self._generation
            if not mine and cur.expires_at > now:
                self._generation = None
                return False
        generation = 0 if cur is None else cur.generation + 1
        record = {"generation": generation, "holder": self.holder, "expires_at": now + self.ttl_s}
        try:
            self.store.create(self._key(generation), json.dumps(record).encode())
        except ObjectExists:
            self._generation = None
            return False
        if self._generation is None:
            log.info("lease.acquired", lease=self.prefix, holder=self.holder, generation=generation,
                     store=self.store.name, stolen_from=cur.holder if cur else None)
        self._generation, self._deadline = generation, started + self.ttl_s
        self._cleanup(generation)
        return True

    def renew(self) -> None:
        """Extend our lease; raises LeaseLost when someone else took it."""
        if self._generation is None or not self.acquire():
            raise LeaseLost(f"{self.store.where(self.prefix)}: lease lost by {self.holder}")

    def release(self) -> None:
        """Hand the lease back at once (an expired record), so another contender need not wait."""
        if self._generation is None:
            return
        generation, self._generation = self._generation + 1, None
        record = {"generation": generation, "holder": self.holder, "expires_at": 0.0}
        with contextlib.suppress(ObjectExists):
            self.store.create(self._key(generation), json.dumps(record).encode())
        log.info("lease.released", lease=self.prefix, holder=self.holder, store=self.store.name)

    def _cleanup(self, generation: int) -> None:
        """Drop records older than the previous generation (best effort: any contender may do it)."""
        for info in self.store.scan(self.prefix):
            tail = info.key[len(self.prefix):]
            if tail.isdigit() and int(tail) < generation - 1:
                self.store.delete(info.key)
