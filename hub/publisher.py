"""Publisher: turns a state dict into a new version in the home store (trainer side of DESIGN.md §5).

It keeps the bit patterns of the version it published last (or, when it holds none, reads the
store's newest version back: `parent.py`), so each call encodes only what changed:
a `delta` part per frame-sized range that has changes, `same` for unchanged tensors, and a dense
`anchor` every K versions (plus, on an anchor, the delta from the parent, so readers one step behind
never download the dense copy). Parts are encoded in parallel threads and packed into
content-addressed objects; the manifest is created with a conditional write, so of two publishers
of version N exactly one wins and the other gets `VersionConflict`.
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Callable, Mapping
from concurrent.futures import Executor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from fleetrl.config import HubConfig
from fleetrl.crashpoints import crash_point
from fleetrl.hub import manifest as mf
from fleetrl.hub.errors import HubError, ObjectExists, VersionConflict
from fleetrl.hub.parent import newest, read_parent
from fleetrl.hub.parts import encode_delta_part, encode_dense_part
from fleetrl.hub.reader import Reader
from fleetrl.hub.signing import Keys
from fleetrl.hub.stores import ObjectStore
from fleetrl.hub.tensors import dtype_name, sha256_words, to_words
from fleetrl.log import get_logger

if TYPE_CHECKING:
    import torch

log = get_logger(__name__)
_EXPECTED_ANCHORS = ("first version", "anchor_interval", "first adapter")
"""Anchor reasons that are the plan, not a fallback (the others are logged as warnings)."""
OBJECT_FRAMES = 64
"""Parts are packed into objects of at most this many frames (256 MiB at the default frame size)."""


@dataclass(frozen=True)
class PublishedVersion:
    version: int
    manifest_key: str
    anchor: int
    sha256: str
    """Of the manifest file's bytes."""
    published_at: float
    bytes_written: int
    """Bytes of new objects plus the manifest."""
    anchor_reason: str | None = None
    """Why this version is an anchor (None for a delta): first version, `anchor_interval`, a change
    of tensor names, shapes or dtypes, or a newest stored version that could not be a parent."""


@dataclass
class _Tensor:
    name: str
    dtype: str
    shape: list[int]
    words: np.ndarray
    sha256: str
    tied_to: str | None = None


def read_latest(store: ObjectStore, run: str) -> int | None:
    from fleetrl.hub.errors import IntegrityError, ObjectNotFound

    try:
        data = store.get(mf.latest_key(run))
    except ObjectNotFound:
        return None
    try:
        return int(json.loads(data)["version"])
    except (ValueError, KeyError, TypeError) as exc:
        raise IntegrityError(f"{store.where(mf.latest_key(run))}: not a latest pointer") from exc


class _ObjectPacker:
    """Packs part payloads back to back into objects of at most `limit` bytes."""

    def __init__(self, limit: int) -> None:
        self.limit, self.done, self.buf, self.size = limit, [], [], 0  # type: ignore[var-annotated]
        self.pending: list[tuple[int, int, int, str]] = []  # (object idx, offset, length, sha)

    def add(self, payload: bytes) -> tuple[int, int, int, str]:
        if self.size and self.size + len(payload) > self.limit:
            self._close()
        ref = (len(self.done), self.size, len(payload), hashlib.sha256(payload).hexdigest())
        self.buf.append(payload)
        self.size += len(payload)
        return ref

    def _close(self) -> None:
        self.done.append(b"".join(self.buf))
        self.buf, self.size = [], 0

    def finish(self) -> list[bytes]:
        if self.buf:
            self._close()
        return list(self.done)


class Publisher:
    """Publishes versions of one run into `store` (the home store), reading parents through `reader`
    (a reader of that same store) when it does not hold them in memory."""

    def __init__(self, store: ObjectStore, run: str, cfg: HubConfig, keys: Callable[[], Keys], pool: Executor,
                 reader: Reader) -> None:
        self.store, self.run, self.cfg, self._keys, self.pool = store, run, cfg, keys, pool
        self.reader = reader
        self._prev: dict[str, _Tensor] | None = None
        self._prev_version: int | None = None
        self._prev_anchor = 0
        self._prev_base: int | None = None
        """The base version of the parent in memory when it is an adapter."""

    def _snapshot(self, state: Mapping[str, torch.Tensor], owned: bool) -> dict[str, _Tensor]:
        """Bit patterns and hashes of every tensor; tied tensors (same storage or same bytes) once.

        Unless the caller hands the tensors over (`owned`), the words are copied: a trainer keeps
        mutating its weights, and they are the next version's parent."""
        names = list(state)
        words = [to_words(state[n]) if owned else np.array(to_words(state[n]), copy=True) for n in names]
        shas = list(self.pool.map(sha256_words, words))
        out: dict[str, _Tensor] = {}
        seen: dict[tuple[str, str, tuple[int, ...]], str] = {}
        for name, w, sha in zip(names, words, shas, strict=True):
            t = state[name]
            key = (dtype_name(t), sha, tuple(t.shape))
            out[name] = _Tensor(name, key[0], list(t.shape), w, sha, tied_to=seen.get(key))
            seen.setdefault(key, name)
        return out

    def _chunks(self, t: _Tensor) -> list[tuple[int, int]]:
        step = max(1, self.cfg.frame_bytes // t.words.dtype.itemsize)
        return [(s, min(s + step, t.words.size)) for s in range(0, max(t.words.size, 1), step)]

    def _difference(self, cur: dict[str, _Tensor]) -> str | None:
        """What makes `cur` unable to be a delta of the parent in memory (None when it can)."""
        prev = self._prev
        assert prev is not None
        if prev.keys() != cur.keys():
            extra, missing = sorted(cur.keys() - prev.keys()), sorted(prev.keys() - cur.keys())
            return f"tensor names differ from version {self._prev_version} (new: {extra[:3]}, gone: {missing[:3]})"
        for n, t in cur.items():  # ties may come and go (equal norm weights diverge): readers copy them
            if (prev[n].dtype, prev[n].shape) != (t.dtype, t.shape):
                return (f"tensor {n} is {t.dtype}{t.shape}, was {prev[n].dtype}{prev[n].shape} in version "
                        f"{self._prev_version}")
        return None

    def _parent_problem(self, latest: int | None, cur: dict[str, _Tensor],
                        adapter: mf.AdapterInfo | None = None) -> str | None:
        """Make the store's newest version the parent in memory (reading it back when another process
        published it); returns why the next version cannot be a delta of it, or None."""
        if latest is None:
            self._prev, self._prev_version = None, None
            return "first version"
        lineage = self._lineage_problem(latest, adapter)
        if lineage is not None:
            return lineage
        if self._prev is None or self._prev_version != latest:
            self._prev, self._prev_version = None, None
            try:
                parent = read_parent(self.reader, latest)
            except HubError as exc:
                return f"newest version {latest} cannot be a parent: {type(exc).__name__}: {exc}"
            entries = {t.name: t for t in parent.manifest.tensors if self._keeps(t.name, cur)}
            self._prev = {n: _Tensor(n, e.dtype, e.shape, parent.words[n], e.sha256) for n, e in entries.items()}
            self._prev_version, self._prev_anchor = latest, parent.manifest.anchor
            self._prev_base = parent.manifest.base
            log.info("hub.parent_read", version=latest, anchor=parent.manifest.anchor, store=self.store.name)
        return self._difference(cur)

    def _lineage_problem(self, latest: int, adapter: mf.AdapterInfo | None) -> str | None:
        """Why version `latest` cannot be the parent of a version on base `adapter.base` (an adapter) or
        of full weights (`adapter` None): adapters delta only against adapters of the same base, full
        weights only against full weights. Decided from the manifest: a base is never read back as an
        adapter's parent."""
        if self._prev is not None and self._prev_version == latest:
            theirs = self._prev_base  # ours: no need to read back what we wrote
        else:
            try:
                theirs = self.reader.manifest(latest).base
            except HubError:
                return None  # the parent read below says what is wrong with it
        ours = None if adapter is None else adapter.base
        if theirs == ours:
            return None
        self._prev, self._prev_version = None, None
        if ours is None:
            return f"first version of full weights after adapter version {latest} (on base {theirs})"
        return f"first adapter on base version {ours}"

    def _keeps(self, name: str, cur: Mapping[str, _Tensor]) -> bool:
        """Whether a parent read back keeps this tensor's bits (all of them, for one process)."""
        return True

    def publish(self, state: Mapping[str, torch.Tensor], *, version: int | None = None,
                owned: bool = False, adapter: mf.AdapterInfo | None = None) -> PublishedVersion:
        """Publish the next version; with `version`, refuse (VersionConflict) unless it is that one. With
        `adapter`, `state` is a LoRA adapter on the base version it names (which must be in the store)."""
        cur = self._snapshot(state, owned)
        latest = newest(self.reader, read_latest(self.store, self.run))
        nxt = 0 if latest is None else latest + 1
        if version is not None and version != nxt:
            raise VersionConflict(f"{self.store.where(mf.latest_key(self.run))}: asked to publish version "
                                  f"{version} but the next version of run {self.run!r} is {nxt} (another "
                                  f"publisher is writing into this run?)")
        if adapter is not None:
            self._check_base(adapter)
        reason = self._parent_problem(latest, cur, adapter)
        can_delta = reason is None
        if can_delta and nxt - self._prev_anchor >= self.cfg.anchor_interval:
            reason = f"anchor_interval: {nxt - self._prev_anchor} versions since anchor {self._prev_anchor}"
        if reason is not None and not reason.startswith(_EXPECTED_ANCHORS):
            log.warning("hub.anchor_instead_of_delta", version=nxt, reason=reason, store=self.store.name)
        return self._write(cur, nxt, latest, reason, can_delta, adapter)

    def _check_base(self, adapter: mf.AdapterInfo) -> None:
        """An adapter is published only on a base of full weights the store holds."""
        try:
            base = self.reader.manifest(adapter.base)
        except HubError as exc:
            raise HubError(f"an adapter on base version {adapter.base}: the base is not readable in "
                           f"{self.store.name}: {exc}") from exc
        if base.adapter is not None:
            raise HubError(f"an adapter on base version {adapter.base}: that version is itself an adapter "
                           f"(on base {base.adapter.base}), not full weights")

    def _write(self, cur: dict[str, _Tensor], version: int, parent: int | None, reason: str | None,
               can_delta: bool, adapter: mf.AdapterInfo | None = None) -> PublishedVersion:
        """Encode, upload, then create the manifest (conditional) and move `latest`."""
        entries, objects = self._encode(cur, anchor=reason is not None, with_delta=can_delta)
        written = self._upload(objects)
        crash_point("hub.publish.objects_written")
        pv = self._commit(entries, {sha: len(o) for sha, o in objects.items()}, version, parent, reason, written,
                          adapter)
        self._prev, self._prev_version, self._prev_anchor = cur, version, pv.anchor
        self._prev_base = None if adapter is None else adapter.base
        return pv

    def _commit(self, entries: list[mf.TensorEntry], objects: dict[str, int], version: int, parent: int | None,
                reason: str | None, written: int, adapter: mf.AdapterInfo | None = None) -> PublishedVersion:
        """Create the signed manifest of uploaded parts (conditional write), then the holder marker
        and `latest`. Raises VersionConflict when another publisher created version N first."""
        manifest = mf.Manifest(
            run=self.run, version=version, parent=parent, anchor=version if reason is not None else self._prev_anchor,
            published_at=time.time(), objects=objects, tensors=entries, adapter=adapter,
        )
        data = mf.dump_signed(manifest, self._keys())
        key = mf.version_key(self.run, version)
        try:
            self.store.create(key, data)
        except ObjectExists as exc:
            self._prev, self._prev_version = None, None  # someone else's version N: ours is not the parent
            raise VersionConflict(f"version {version} already published at {self.store.where(key)}") from exc
        crash_point("hub.publish.manifest_written")
        sha = hashlib.sha256(data).hexdigest()
        pointer = {"version": version, "manifest": key, "anchor": manifest.anchor,
                   "sha256": sha, "published_at": manifest.published_at}
        self.store.put(mf.holder_key(self.run, version, self.store.name), b"")
        crash_point("hub.publish.holder_written")
        self.store.put(mf.latest_key(self.run), json.dumps(pointer).encode())
        log.info("hub.published", version=version, anchor=manifest.anchor, bytes=written + len(data),
                 tensors=len(entries), store=self.store.name, anchor_reason=reason, base=manifest.base)
        return PublishedVersion(version, key, manifest.anchor, sha, manifest.published_at,
                                written + len(data), reason)

    def _encode(self, cur: dict[str, _Tensor], *, anchor: bool, with_delta: bool
                ) -> tuple[list[mf.TensorEntry], dict[str, bytes]]:
        """Encode every tensor's parts in parallel; returns entries and objects by sha256."""
        level, prev = self.cfg.zstd_level, self._prev
        jobs: list[tuple[str, str, int, int]] = []  # (tensor, kind, start, stop)
        for t in cur.values():
            if t.tied_to is not None:
                continue
            changed = with_delta and prev is not None and prev[t.name].sha256 != t.sha256
            for start, stop in self._chunks(t):
                if anchor:
                    jobs.append((t.name, "dense", start, stop))
                if changed:
                    jobs.append((t.name, "delta", start, stop))

        def run(job: tuple[str, str, int, int]) -> tuple[bytes, str | None] | None:
            name, kind, start, stop = job
            new = cur[name].words[start:stop]
            if kind == "dense":
                return encode_dense_part(new, level), None
            assert prev is not None
            return encode_delta_part(prev[name].words[start:stop], new, level)

        payloads = list(self.pool.map(run, jobs))
        # Dense and delta parts go to separate objects: a reader one step behind an anchor fetches
        # the small delta object whole and never touches the dense one.
        packers = {kind: _ObjectPacker(OBJECT_FRAMES * self.cfg.frame_bytes) for kind in ("dense", "delta")}
        refs: dict[tuple[str, str], list[tuple[tuple[int, int, int, str], int, int, str | None]]] = {}
        for (name, kind, start, stop), encoded in zip(jobs, payloads, strict=True):
            refs.setdefault((name, kind), [])
            if encoded is not None:
                idx, off, n, sha = packers[kind].add(encoded[0])
                refs[(name, kind)].append(((idx if kind == "dense" else -1 - idx, off, n, sha), start, stop,
                                           encoded[1]))
        dense, delta = packers["dense"].finish(), packers["delta"].finish()
        blobs = dense + delta
        shas = [hashlib.sha256(b).hexdigest() for b in blobs]
        shas_at = {i: shas[i] for i in range(len(dense))} | {-1 - i: shas[len(dense) + i] for i in range(len(delta))}

        def part_refs(name: str, kind: str) -> list[mf.PartRef]:
            return [mf.PartRef(object=shas_at[i], offset=off, length=n, sha256=sha, start=s, stop=e,
                               changed_digest=digest)
                    for (i, off, n, sha), s, e, digest in refs.get((name, kind), [])]

        entries = []
        for t in cur.values():
            base: dict[str, Any] = {"name": t.name, "dtype": t.dtype, "shape": t.shape, "sha256": t.sha256}
            if t.tied_to is not None:
                entries.append(mf.TensorEntry(**base, encoding="tied", tied_to=t.tied_to))
            elif anchor:
                entries.append(mf.TensorEntry(**base, encoding="anchor", parts=part_refs(t.name, "dense"),
                                              delta=part_refs(t.name, "delta") if with_delta else None))
            elif refs.get((t.name, "delta")):
                entries.append(mf.TensorEntry(**base, encoding="delta", parts=part_refs(t.name, "delta")))
            else:
                entries.append(mf.TensorEntry(**base, encoding="same"))
        return entries, dict(zip(shas, blobs, strict=True))

    def _upload(self, objects: dict[str, bytes]) -> int:
        """Create each object unless the store has it already (content-addressed); returns bytes sent."""

        def put(item: tuple[str, bytes]) -> int:
            sha, blob = item
            key = mf.object_key(self.run, sha)
            if self.store.exists(key):
                return 0
            try:
                self.store.create(key, blob)
            except ObjectExists:
                return 0  # another writer uploaded the same content
            return len(blob)

        return sum(self.pool.map(put, objects.items()))
