"""Object stores holding hub objects: a local directory or an S3-API bucket (DESIGN.md §5).

Every store has the same small surface: ranged `get`, atomic `put`, conditional `create` (exactly
one of two writers of a key wins), `scan` (list a prefix), `delete`. Objects are immutable except `latest` and the
lease records, so no reader ever sees a partly written object: a directory store writes a temporary
file and renames it (or hard-links it for `create`, which fails if the key exists, like O_EXCL but
with the whole content visible at once); S3 PUTs are atomic and `create` sends `IfNoneMatch: *`.
Each store counts its GETs and bytes so replication can be measured and exported as metrics.
"""

from __future__ import annotations

import abc
import contextlib
import os
import pathlib
import tempfile
import threading
import time
import urllib.parse
import uuid
from dataclasses import dataclass, field

from fleetrl.config import StoreConfig
from fleetrl.hub.errors import ObjectExists, ObjectNotFound, StoreError


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


class DirStore(ObjectStore):
    """A local (or shared-filesystem) directory."""

    def __init__(self, name: str, root: str | os.PathLike[str]) -> None:
        self.root = pathlib.Path(root)
        super().__init__(name, self.root.as_uri() if self.root.is_absolute() else str(self.root))
        self.root.mkdir(parents=True, exist_ok=True)

    def _path(self, key: str) -> pathlib.Path:
        if not key or key.startswith("/") or ".." in key.split("/"):
            raise StoreError(f"invalid key {key!r} for {self.url}", retriable=False)
        return self.root / key

    def _get(self, key: str, start: int | None, end: int | None) -> bytes:
        try:
            with open(self._path(key), "rb") as f:
                if start is None:
                    return f.read()
                f.seek(start)
                return f.read((end if end is not None else 1 << 62) - start)
        except FileNotFoundError as exc:
            raise ObjectNotFound(f"no object {self.where(key)}") from exc
        except OSError as exc:
            raise StoreError(f"cannot read {self.where(key)}: {exc.strerror}") from exc

    def _temp(self, path: pathlib.Path, data: bytes) -> str:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        return tmp

    def _put(self, key: str, data: bytes) -> None:
        path = self._path(key)
        tmp = self._temp(path, data)
        os.replace(tmp, path)

    def _create(self, key: str, data: bytes) -> None:
        path = self._path(key)
        tmp = self._temp(path, data)
        try:
            os.link(tmp, path)  # atomic and exclusive: fails with EEXIST, never shows a partial file
        except FileExistsError as exc:
            raise ObjectExists(f"{self.where(key)} already exists") from exc
        finally:
            os.unlink(tmp)

    def _scan(self, prefix: str) -> list[ObjectInfo]:
        base = self.root / prefix.rsplit("/", 1)[0] if "/" in prefix else self.root
        if not base.is_dir():
            return []
        out = []
        for dirpath, _, files in os.walk(base):
            for name in files:
                if name.startswith("."):
                    continue  # temporary files of writes in flight
                full = pathlib.Path(dirpath) / name
                key = full.relative_to(self.root).as_posix()
                if key.startswith(prefix):
                    try:
                        st = full.stat()
                    except FileNotFoundError:
                        continue  # deleted while listing
                    out.append(ObjectInfo(key, st.st_size, st.st_mtime))
        return out

    def exists(self, key: str) -> bool:
        return self._path(key).is_file()

    def delete(self, key: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            self._path(key).unlink()


def open_store(name: str, config: StoreConfig, *, threads: int = 4) -> ObjectStore:
    """The store a `StoreConfig` describes, named `name` (`home` or a region)."""
    if config.scheme == "s3":
        from fleetrl.hub.s3 import S3Store

        return S3Store(name, config, max_connections=max(10, 2 * threads))
    url = config.url
    path = urllib.parse.unquote(urllib.parse.urlparse(url).path) if url.startswith("file://") else url
    return DirStore(name, path)


def unique_id() -> str:
    """An id for one process's writer (lease holder, temp names): host, pid and a random tail."""
    return f"{os.uname().nodename}-{os.getpid()}-{uuid.uuid4().hex[:6]}"


def now_s() -> float:
    return time.time()
