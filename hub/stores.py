"""Object stores holding hub objects: a local directory or an S3-API bucket (DESIGN.md §5).

Every store has the same small surface: ranged `get`, atomic `put`, conditional `create` (exactly
one of two writers of a key wins), `scan` (list a prefix), `delete`. Objects are immutable except `latest` and the
lease records, so no reader ever sees a partly written object: a directory store writes a temporary
file and renames it (or hard-links it for `create`, which fails if the key exists, like O_EXCL but
with the whole content visible at once); S3 PUTs are atomic and `create` sends `IfNoneMatch: *`.
Each store counts its GETs and bytes so replication can be measured and exported as metrics.
"""

from __future__ import annotations

import contextlib
import os
import pathlib
import tempfile
import time
import urllib.parse
import uuid

from fleetrl.config import StoreConfig
from fleetrl.hub.errors import ObjectExists, ObjectNotFound, StoreError
from fleetrl.hub.store_api import ObjectInfo, ObjectStore, StoreStats

__all__ = ["DirStore", "ObjectInfo", "ObjectStore", "StoreStats", "now_s", "open_store", "unique_id"]


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
