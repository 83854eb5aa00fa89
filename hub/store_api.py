"""The object store's interface (DESIGN.md §5): what every store offers, and the counters each keeps.

`ObjectStore` is the small surface the hub reads and writes through: ranged `get`, atomic `put`,
conditional `create`, `scan`, `exists`, `delete`. Its implementations are `stores.DirStore` (a local
directory) and `s3.S3Store` (an S3-API bucket); `stores.open_store` picks one from the config. Both
implementations import this module, never each other.
"""

from __future__ import annotations

import abc
import threading
from dataclasses import dataclass, field


@dataclass(frozen=True)
class ObjectInfo:
    key: str
    size: int
    modified: float
    """Seconds since the epoch of the last write."""


@dataclass
class StoreStats:
    """Counters of one store client (thread-safe): what replication and readers cost."""

    gets: int = 0
    get_bytes: int = 0
    object_gets: int = 0
    """GETs of hub objects (weights), as opposed to manifests, pointers and markers."""
    object_bytes: int = 0
    puts: int = 0
    put_bytes: int = 0
    lists: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def add(self, **counts: int) -> None:
        with self._lock:
            for name, value in counts.items():
                setattr(self, name, getattr(self, name) + value)


class ObjectStore(abc.ABC):
    """One store; keys are '/'-separated paths below the store's root."""

    def __init__(self, name: str, url: str) -> None:
        self.name, self.url = name, url
        self.stats = StoreStats()

    def where(self, key: str) -> str:
        """Full address of a key, for error messages."""
        return f"{self.url.rstrip('/')}/{key}"

    def get(self, key: str, start: int | None = None, end: int | None = None) -> bytes:
        """The object's bytes, or bytes [start, end) of it (one ranged GET)."""
        data = self._get(key, start, end)
        obj = "/objects/" in key
        self.stats.add(gets=1, get_bytes=len(data), object_gets=int(obj), object_bytes=len(data) if obj else 0)
        return data

    def put(self, key: str, data: bytes) -> None:
        """Write (or replace) a key atomically."""
        self._put(key, data)
        self.stats.add(puts=1, put_bytes=len(data))

    def create(self, key: str, data: bytes) -> None:
        """Write a key that must not exist yet; raises ObjectExists when someone else wrote it first."""
        self._create(key, data)
        self.stats.add(puts=1, put_bytes=len(data))

    def scan(self, prefix: str) -> list[ObjectInfo]:
        """Objects whose key starts with `prefix`, sorted by key."""
        self.stats.add(lists=1)
        return sorted(self._scan(prefix), key=lambda info: info.key)

    @abc.abstractmethod
    def _get(self, key: str, start: int | None, end: int | None) -> bytes: ...

    @abc.abstractmethod
    def _put(self, key: str, data: bytes) -> None: ...

    @abc.abstractmethod
    def _create(self, key: str, data: bytes) -> None: ...

    @abc.abstractmethod
    def _scan(self, prefix: str) -> list[ObjectInfo]: ...

    @abc.abstractmethod
    def exists(self, key: str) -> bool: ...

    @abc.abstractmethod
    def delete(self, key: str) -> None:
        """Remove a key; a missing key is not an error."""
