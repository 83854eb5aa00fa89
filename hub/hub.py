"""`Hub`: the public face of the tensor hub for the trainer, the rollout engines and the CLI.

    hub = Hub.from_config(config, store="eu-west-1")   # reads go to that store only
    pv = hub.publish(state_dict)                          # into the home store, a delta when it can be
    sd = hub.materialize(pv.version, into=sd, have_version=pv.version - 1)

One thread pool (`hub.threads`) serves hashing, compression, decoding and parallel GETs.
"""

from __future__ import annotations

import hashlib
import os
import pathlib
import tempfile
import threading
import time
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, NamedTuple, TypeVar

from fleetrl.config import FleetConfig
from fleetrl.hub import inplace, retention
from fleetrl.hub import manifest as mf
from fleetrl.hub.errors import BaseMismatch, HubError
from fleetrl.hub.parent import newest
from fleetrl.hub.publisher import PublishedVersion, Publisher, read_latest
from fleetrl.hub.reader import Progress, Reader, Step, empty_words
from fleetrl.hub.retention import GcReport, collect, gaps, stored_versions
from fleetrl.hub.sharded import ShardPublisher
from fleetrl.hub.signing import Keys, load_keys
from fleetrl.hub.stores import ObjectStore, open_store
from fleetrl.hub.tensors import dtype_name, from_words, sha256_words, to_words

if TYPE_CHECKING:
    import numpy as np
    import torch

P = TypeVar("P", bound=Publisher)


class Changed(NamedTuple):
    """The elements of one tensor that a chain of versions changed (`Hub.changes`)."""

    positions: np.ndarray
    """Flat positions into the tensor's elements (int64, increasing)."""
    values: torch.Tensor
    """Their new values: a 1-D CPU tensor of the tensor's dtype, as long as `positions`, of its own
    memory (the caller's state may change under it with the next version)."""


class Hub:
    """Publish to the home store and read from one store (`home` or a region's)."""

    def __init__(self, config: FleetConfig, store: str = "home",
                 stores: Mapping[str, ObjectStore] | None = None) -> None:
        configs = config.stores()
        if store not in configs:
            raise HubError(f"no store {store!r} in config; stores: {sorted(configs)}")
        self.config, self.run, self.cfg = config, config.run, config.hub
        self.pool = ThreadPoolExecutor(max_workers=self.cfg.threads, thread_name_prefix="fleetrl-hub")
        given = dict(stores or {})
        self.store = given.get(store) or open_store(store, configs[store], threads=self.cfg.threads)
        self.home = self.store if store == "home" else (
            given.get("home") or open_store("home", configs["home"], threads=self.cfg.threads))
        self._keys: Keys | None = None
        self._lock = threading.Lock()
        self.reader = Reader(self.store, self.run, self.keys, self.pool, self.cfg.anchor_interval,
                             self.cfg.frame_bytes, self.cfg.threads)
        self._publisher: Publisher | None = None

    @classmethod
    def from_config(cls, config: FleetConfig, store: str = "home") -> Hub:
        return cls(config, store)

    def keys(self) -> Keys:
        """Signing/verification keys, loaded on first use (so `ls` works without a key)."""
        with self._lock:
            if self._keys is None:
                self._keys = load_keys(self.cfg.signing)
            return self._keys

    def close(self) -> None:
        self.pool.shutdown(wait=True)

    def __enter__(self) -> Hub:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- publishing -------------------------------------------------------------------------

    def publish(self, state_dict: Mapping[str, torch.Tensor], *, version: int | None = None,
                owned: bool = False, adapter: mf.AdapterInfo | None = None) -> PublishedVersion:
        """Publish the next version of `state_dict` (tensors in publish dtype) into the home store.

        Deltas against the version this hub published last or, when it holds none (a new process),
        against the store's newest version, read back and verified first; an anchor when that is
        impossible (`PublishedVersion.anchor_reason` says why) or every `hub.anchor_interval`
        versions. With `version`, raises VersionConflict unless that is the next version. With
        `owned`, the caller hands the tensors over (it will not modify them): they are not copied.
        With `adapter`, `state_dict` is a LoRA adapter (peft's names) on the full-weights version
        `adapter.base` of this store: its chain of deltas and anchors runs over adapter versions only.
        """
        if self._publisher is None:
            self._publisher = self._new_publisher(Publisher)
        return self._publisher.publish(state_dict, version=version, owned=owned, adapter=adapter)

    def shard_publisher(self) -> ShardPublisher:
        """A publisher for one rank of a sharded trainer (see hub/sharded.py); keep it across versions."""
        return self._new_publisher(ShardPublisher)

    def _new_publisher(self, kind: type[P]) -> P:
        reader = self.reader if self.store is self.home else Reader(
            self.home, self.run, self.keys, self.pool, self.cfg.anchor_interval, self.cfg.frame_bytes,
            self.cfg.threads)
        return kind(self.home, self.run, self.cfg, self.keys, self.pool, reader)

    # --- reading ----------------------------------------------------------------------------

    def latest(self) -> int | None:
        """The version the store's `latest` pointer names (None before the first publish)."""
        return read_latest(self.store, self.run)

    def newest(self) -> int | None:
        """The newest complete version: `latest`, or a later one whose manifest is there and verifies
        (its publisher was killed before it moved `latest`); the version the next publish builds on."""
        return newest(self.reader, self.latest())

    def holds(self, state_dict: Mapping[str, torch.Tensor], version: int) -> bool:
        """Whether `version` is exactly `state_dict`: the same tensor names, dtypes and shapes, and every
        tensor's sha256 the one its signed manifest records."""
        entries = {t.name: t for t in self.reader.manifest(version).tensors}
        if entries.keys() != state_dict.keys():
            return False
        for name, tensor in state_dict.items():
            e = entries[name]
            if (dtype_name(tensor), list(tensor.shape)) != (e.dtype, list(e.shape)):
                return False
        shas = self.pool.map(lambda n: sha256_words(to_words(state_dict[n].cpu())), list(entries))
        return all(sha == entries[n].sha256 for n, sha in zip(entries, shas, strict=True))

    def published(self, version: int) -> PublishedVersion:
        """What publishing `version` returned, read back from its (verified) manifest."""
        key = mf.version_key(self.run, version)
        data = self.store.get(key)
        manifest = self.reader.manifest(version)
        return PublishedVersion(version, key, manifest.anchor, hashlib.sha256(data).hexdigest(),
                                manifest.published_at, 0)

    def versions(self) -> list[int]:
        """Every version whose manifest is in this store, ascending."""
        return stored_versions(self.store, self.run)

    def manifest(self, version: int) -> mf.Manifest:
        return self.reader.manifest(version)

    def holders(self, version: int) -> list[str]:
        prefix = mf.holders_prefix(self.run, version)
        return [i.key[len(prefix):] for i in self.store.scan(prefix)]

    def gc(self, *, dry_run: bool = False) -> GcReport:
        """Delete from this hub's store what the retention window no longer needs."""
        return collect(self.store, self.reader, self.run, self.cfg.retention_versions, self.cfg.gc_grace_s,
                       dry_run=dry_run)

    def pin(self, version: int, pinned: bool = True, holder: str | None = None) -> None:
        """Keep `version` through retention (an unfinished evaluation needs it), or release it; `holder`
        names a pin of its own (`<run>/pins/<N>-<holder>`: a `fleetrl eval` request), None the trainer's."""
        (retention.pin if pinned else retention.unpin)(self.store, self.run, version, holder)

    def pinned(self) -> list[int]:
        return retention.pinned_versions(self.store, self.run)

    def wait_for_version(self, min_version: int, timeout_s: float) -> int:
        """Poll `latest` until it reaches `min_version`; returns it, or raises a retriable HubError."""
        deadline = time.monotonic() + timeout_s
        while True:
            latest = self.latest()
            if latest is not None and latest >= min_version:
                return latest
            left = deadline - time.monotonic()
            if left <= 0:
                raise HubError(f"{self.store.where(mf.latest_key(self.run))}: version {min_version} not "
                               f"published within {timeout_s:.1f} s (latest {latest})", retriable=True)
            time.sleep(min(self.cfg.poll_interval_s, left))

    def materialize(self, version: int, into: dict[str, torch.Tensor] | None = None,
                    have_version: int | None = None, progress: Progress | None = None,
                    verify_full: bool = False) -> dict[str, torch.Tensor]:
        """The full state dict at `version`.

        With `into` (holding `have_version`), tensors are updated in place, from the caller's state when
        that is on the chain and cheaper, else from the nearest anchor. On any error `into` is left bit
        for bit as it was: a state built from an anchor is checked against each tensor's sha256 before
        it is copied in; an in-place delta update checks the sha256 of the words it writes (O(changes))
        and puts back every word already written when a part fails; with `verify_full`, each whole
        tensor's sha256 is checked on private copies (O(model), also catching a wrong `have_version`
        in elements the chain does not touch).
        """
        target = self.reader.manifest(version)
        entries = {t.name: t for t in target.tensors}
        usable = into is not None and _matches(into, entries)
        steps, from_caller = self.reader.plan(version, have_version if usable else None)
        work: dict[str, np.ndarray]
        if from_caller and into is not None and not verify_full and self._in_place_ok(steps, entries, into):
            self._deltas_in_place(steps, entries, into, progress, positions=False)
            return into
        if from_caller:
            assert into is not None
            work = {n: to_words(into[n]).copy() for n in self.reader.touched(steps)}
        else:
            work = {n: empty_words(e) for n, e in entries.items()}
        self.reader.apply(steps, work, progress)
        self.reader.verify(version, work, set(work))
        out = {n: from_words(w, entries[n].dtype, entries[n].shape) for n, w in work.items()
               if entries[n].encoding != "tied"}
        return _hand_out(out, entries, into)

    def changes(self, version: int, into: dict[str, torch.Tensor], have_version: int,
                progress: Progress | None = None) -> dict[str, Changed] | None:
        """Bring `into` (holding `have_version`) to `version` in place along the delta chain, as
        `materialize` does, and return per tensor the elements the chain changed, their positions and
        new values: all an engine holding `have_version` must write. One version behind (the common
        case) the kernel writes both out in the pass that applies the delta: no second decode, no
        gather. Tied names are listed with the tensor they share. Every changed word is checked
        against its part's digest before anything is written. None (and `into` untouched) where
        deltas in place cannot get there: an anchor is nearer, the chain is broken, or `into` does not
        match; then `materialize`."""
        entries = {t.name: t for t in self.reader.manifest(version).tensors}
        if not _matches(into, entries):
            return None
        steps, from_caller = self.reader.plan(version, have_version)
        if not from_caller or not self._in_place_ok(steps, entries, into):
            return None
        return self._deltas_in_place(steps, entries, into, progress, positions=True)

    def _deltas_in_place(self, steps: list[Step], entries: Mapping[str, mf.TensorEntry], into: dict[str, Any],
                         progress: Progress | None, positions: bool) -> dict[str, Changed]:
        """Apply a chain of delta steps straight into `into` (see `materialize`); with `positions`, the
        changes per tensor (tied names included)."""
        import numpy as np

        changed = {n for step in steps for n, _ in self.reader.refs(step)}
        targets = {n: to_words(into[n]) for n in changed}
        words: dict[str, tuple[np.ndarray, np.ndarray]] = {}
        if len(steps) == 1:  # one version behind: the common case, checked and applied per part
            words = inplace.apply_step(self.reader, steps[0], targets, progress, record=positions)
        else:
            decoded = self.reader.decode(steps, {n: t.size for n, t in targets.items()}, progress)
            self.reader.apply_verified(decoded, targets)
            if positions:
                for n, parts in decoded.items():
                    pos = np.unique(np.concatenate([d.pos + r.start for _, d, r in parts if d.pos is not None]))
                    words[n] = (pos, targets[n][pos])
        found = {n: Changed(pos, from_words(w, entries[n].dtype, [w.size])) for n, (pos, w) in words.items()}
        for n, e in entries.items():
            if e.encoding == "tied" and e.tied_to:
                if into[n].data_ptr() != into[e.tied_to].data_ptr():
                    into[n].copy_(into[e.tied_to])
                if e.tied_to in found:
                    found[n] = found[e.tied_to]
        return found

    def materialize_adapter(self, version: int, base: int | None, into: dict[str, torch.Tensor] | None = None,
                            have_version: int | None = None, progress: Progress | None = None
                            ) -> tuple[mf.AdapterInfo, dict[str, torch.Tensor]]:
        """The LoRA adapter of `version` for a reader that holds full-weights version `base`.

        Refuses (BaseMismatch) an adapter of another base, and (HubError) a version of full weights:
        the caller must load that version whole. `into` / `have_version` are the caller's adapter of an
        earlier version, updated in place along the adapter chain as `materialize` does."""
        target = self.reader.manifest(version)
        where = self.store.where(mf.version_key(self.run, version))
        if target.adapter is None:
            raise HubError(f"{where}: version {version} is full weights, not an adapter")
        if target.adapter.base != base:
            held = "no base" if base is None else f"base version {base}"
            raise BaseMismatch(f"{where}: version {version} is an adapter of base version {target.adapter.base}; "
                               f"this reader holds {held}")
        if have_version is not None and self.reader.manifest(have_version).base != base:
            into, have_version = None, None  # an adapter of another base: start from this chain's anchor
        return target.adapter, self.materialize(version, into=into, have_version=have_version, progress=progress)

    def verify_store(self, progress: Callable[[int], None] | None = None) -> StoreCheck:
        """Check every version in this hub's store, oldest first: numbers gapless (but for a LoRA run's
        base kept before its adapter chain, `retention.gaps`), `latest` one of them, and each version
        materialized along its chain with every tensor's sha256 checked against its signed manifest.
        Errors are collected (one per version), not raised."""
        latest = self.latest()  # before the listing: a manifest is created before `latest` names it
        versions = self.versions()
        check = StoreCheck(self.store.name, versions, latest)
        if versions:
            try:
                check.gaps = gaps(versions, self.reader.manifest)
            except HubError:  # the manifest after a missing run does not verify: counted below, and the run
                check.gaps = sorted(set(range(versions[0], versions[-1] + 1)) - set(versions))
        state: dict[str, torch.Tensor] | None = None
        have: int | None = None
        for v in versions:
            try:
                state = self.materialize(v, into=state, have_version=have, verify_full=True)
                have = v
            except HubError as exc:
                check.bad[v] = f"{type(exc).__name__}: {exc}"
                state, have = None, None
            if progress is not None:
                progress(v)
        return check

    def materialize_to_safetensors(self, version: int, path: str | os.PathLike[str],
                                   progress: Progress | None = None) -> pathlib.Path:
        """Write `version` as a safetensors file (tied tensors once, as Hugging Face saves them)."""
        from safetensors.torch import save_file

        state = self.materialize(version, progress=progress)
        entries = self.reader.manifest(version).tensors
        tensors = {t.name: state[t.name] for t in entries if t.encoding != "tied"}
        meta = {"fleetrl.run": self.run, "fleetrl.version": str(version)}
        out = pathlib.Path(path)
        fd, tmp = tempfile.mkstemp(dir=out.parent or ".", prefix=f".{out.name}.", suffix=".tmp")
        os.close(fd)
        try:
            save_file(tensors, tmp, metadata=meta)
            os.replace(tmp, out)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
        return out


    def _in_place_ok(self, steps: list[Step], entries: Mapping[str, mf.TensorEntry], into: Mapping[str, Any]) -> bool:
        """Whether the chain can be checked on scratch blocks and then applied straight into `into`:
        CPU contiguous tensors, ties unchanged along the chain, no storage shared by untied tensors."""
        ties = {(n, e.tied_to) for n, e in entries.items() if e.encoding == "tied"}
        for step in steps:
            m = self.reader.manifest(step.version)
            if {(t.name, t.tied_to) for t in m.tensors if t.encoding == "tied"} != ties:
                return False
        root = {n: (e.tied_to if e.encoding == "tied" and e.tied_to else n) for n, e in entries.items()}
        owner: dict[int, str] = {}
        for n in entries:
            t = into[n]
            if t.device.type != "cpu" or not t.is_contiguous():
                return False
            if owner.setdefault(t.data_ptr(), root[n]) != root[n] and t.numel():
                return False
        return True


@dataclass
class StoreCheck:
    """What `Hub.verify_store` found in one store."""

    store: str
    versions: list[int]
    latest: int | None
    gaps: list[int] = field(default_factory=list)
    bad: dict[int, str] = field(default_factory=dict)
    """Version -> why it does not verify."""

    @property
    def ahead(self) -> list[int]:
        """Versions whose manifest is written but that `latest` does not name yet: a publish or a copy
        under way, or one whose process died there (its restart moves `latest`)."""
        return [v for v in self.versions if self.latest is None or v > self.latest]

    @property
    def ok(self) -> bool:
        """Whole: gapless, every version verified, and `latest` one of them (at any moment, also while a
        version is being written: see `ahead`)."""
        return not self.gaps and not self.bad and (self.latest in self.versions or self.latest is None)

    def as_dict(self) -> dict[str, Any]:
        return {"store": self.store, "ok": self.ok, "first": self.versions[0] if self.versions else None,
                "newest": self.versions[-1] if self.versions else None, "latest": self.latest,
                "versions": len(self.versions), "ahead": self.ahead, "gaps": self.gaps,
                "bad": {str(k): v for k, v in self.bad.items()}}


def _matches(into: Mapping[str, Any], entries: Mapping[str, mf.TensorEntry]) -> bool:
    """Whether `into` has every tensor of the manifest with the same dtype and shape."""
    for name, e in entries.items():
        t = into.get(name)
        if t is None or str(t.dtype).removeprefix("torch.") != e.dtype or list(t.shape) != e.shape:
            return False
    return True


def _hand_out(out: dict[str, Any], entries: Mapping[str, mf.TensorEntry],
              into: dict[str, Any] | None) -> dict[str, Any]:
    """Give the verified tensors to the caller: copied into `into` in place, or as a new dict.

    Tied tensors are handed out as one tensor, as a tied model's `state_dict()` has them. Tensors of
    `into` that share storage without being tied in this version (equal norm weights tied by content
    in an earlier version, say) are separated first, so writing one never changes the other.
    """
    if into is None:
        result = {n: out[n] for n in entries if n in out}
        for n, e in entries.items():
            if e.encoding == "tied" and e.tied_to is not None:
                result[n] = result[e.tied_to]
        return result
    root = {n: (e.tied_to if e.encoding == "tied" and e.tied_to else n) for n, e in entries.items()}
    sharing: dict[int, set[str]] = {}
    for n in entries:
        if n in into:
            sharing.setdefault(into[n].data_ptr(), set()).add(n)
    for n, t in out.items():
        current = into.get(n)
        if current is None or list(current.shape) != list(t.shape) or current.dtype != t.dtype:
            into[n] = t
            continue
        group = sharing.get(current.data_ptr(), {n})
        if any(root.get(m) != root[n] for m in group):
            group.discard(n)
            into[n] = t  # break an alias this version does not have
        else:
            current.copy_(t)
    for n, e in entries.items():
        if e.encoding == "tied" and e.tied_to is not None and e.tied_to in out:
            src = into[e.tied_to]
            if n not in into or list(into[n].shape) != list(src.shape) or into[n].dtype != src.dtype:
                into[n] = src
            elif into[n].data_ptr() != src.data_ptr():
                into[n].copy_(src)
    return into
