"""Reader: materializes a version from one store (rollout side of DESIGN.md §5).

A reader that holds version h and wants N applies the deltas h+1..N when that is on the chain and
cheaper in bytes than starting over; otherwise it starts from N's anchor. Parts are fetched with as
few GETs as possible (one ranged GET per run of neighbouring parts, the whole object when most of it
is needed), every part's sha256 is checked (by the thread that decodes it) before it is decoded.
From an anchor, parts are applied into private copies and every tensor's sha256 is checked before
anything reaches the caller. One version behind, in place, `inplace.apply_step` writes each part's
changes with a compiled kernel and checks them against the part's `changed_digest`, and on any
failure every written word is put back; either way an error never leaves a half-applied state dict
behind.
"""

from __future__ import annotations

import functools
import hashlib
from collections.abc import Callable, Mapping
from concurrent.futures import Executor
from dataclasses import dataclass

import numpy as np

from fleetrl.hub import kernels
from fleetrl.hub import manifest as mf
from fleetrl.hub.batching import RANGE_FRAMES, ranged_gets
from fleetrl.hub.errors import CodecError, HubError, IntegrityError, ObjectNotFound
from fleetrl.hub.parts import Decoded, apply_window, decode_part
from fleetrl.hub.signing import Keys
from fleetrl.hub.stores import ObjectStore
from fleetrl.hub.streams import new_values
from fleetrl.hub.tensors import sha256_words, word_dtype

Progress = Callable[[int], None]


@dataclass(frozen=True)
class Step:
    """Apply these parts of `version`: its dense anchor, or its delta from the previous version."""

    version: int
    dense: bool


class Reader:
    def __init__(self, store: ObjectStore, run: str, keys: Callable[[], Keys], pool: Executor,
                 anchor_interval: int, frame_bytes: int, threads: int = 1) -> None:
        self.store, self.run, self._keys, self.pool = store, run, keys, pool
        self.range_bytes = RANGE_FRAMES * frame_bytes
        self.anchor_interval = anchor_interval
        self._manifests: dict[int, mf.Manifest] = {}
        self._entries: dict[int, dict[str, mf.TensorEntry]] = {}
        self._ref_cache: dict[tuple[Step, int], tuple[mf.Manifest, list[tuple[str, mf.PartRef]]]] = {}
        self.threads = max(1, threads)

    def manifest(self, version: int) -> mf.Manifest:
        """The verified manifest of `version` (cached: manifests are immutable)."""
        cached = self._manifests.get(version)
        if cached is None:
            key = mf.version_key(self.run, version)
            data = self.store.get(key)
            cached = mf.load_signed(data, self._keys(), self.store.where(key), run=self.run, version=version)
            if len(self._manifests) > 256:
                self._manifests.clear()
                self._entries.clear()
            self._manifests[version] = cached
        return cached

    def remember(self, manifest: mf.Manifest) -> None:
        """Cache a manifest verified elsewhere (a replicator's, before it is written to this store)."""
        self._manifests[manifest.version] = manifest

    # --- planning ---------------------------------------------------------------------------

    def refs(self, step: Step) -> list[tuple[str, mf.PartRef]]:
        """(tensor, part) pairs a step applies: an anchor's dense parts, or a version's delta parts."""
        m = self.manifest(step.version)
        cached = self._ref_cache.get((step, id(m)))
        if cached is not None:
            return cached[1]
        out: list[tuple[str, mf.PartRef]] = []
        for t in m.tensors:
            if step.dense:
                refs = t.parts if t.encoding == "anchor" else []
            elif m.is_anchor:
                refs = t.delta or []
            else:
                refs = t.parts if t.encoding == "delta" else []
            out.extend((t.name, r) for r in refs)
        if len(self._ref_cache) > 256:
            self._ref_cache.clear()
        self._ref_cache[(step, id(m))] = (m, out)  # holding `m` keeps its id from being reused
        return out

    def touched(self, steps: list[Step]) -> set[str]:
        """Names a chain of steps writes: tensors with parts, and tensors tied to another on the way."""
        names = {name for step in steps for name, _ in self.refs(step)}
        for step in steps:
            names.update(t.name for t in self.manifest(step.version).tensors if t.encoding == "tied")
        return names

    def _delta_chain(self, have: int, version: int) -> list[Step] | None:
        """Deltas have+1..version, or None when some version lacks one (e.g. the very first anchor)."""
        if not 0 <= version - have <= self.anchor_interval:
            return None
        steps = []
        for v in range(have + 1, version + 1):
            try:
                m = self.manifest(v)
            except ObjectNotFound:
                return None  # not in this store (retired, or a hole an older replicator left): from the anchor
            if m.parent != v - 1 or (m.is_anchor and any(
                    t.delta is None for t in m.tensors if t.encoding == "anchor")):
                return None
            steps.append(Step(v, dense=False))
        return steps

    def plan(self, version: int, have: int | None) -> tuple[list[Step], bool]:
        """Steps to reach `version`, and whether they start from the caller's state (True) or zeros."""
        target = self.manifest(version)
        from_anchor = [Step(target.anchor, dense=True)] + [
            Step(v, dense=False) for v in range(target.anchor + 1, version + 1)]
        chain = self._delta_chain(have, version) if have is not None else None
        if chain is not None:
            cost = self._cost(chain)
            # The dense anchor alone usually outweighs the chain: only then read the other manifests.
            if cost <= self._cost(from_anchor[:1]) or cost <= self._cost(from_anchor):
                return chain, True
        return from_anchor, False

    def _cost(self, steps: list[Step]) -> int:
        return sum(r.length for s in steps for _, r in self.refs(s))

    def bytes_to_read(self, version: int, have: int | None = None) -> int:
        """Compressed bytes `plan(version, have)` will fetch (for progress bars)."""
        return self._cost(self.plan(version, have)[0])

    # --- fetching ---------------------------------------------------------------------------

    def fetch(self, version: int, refs: list[tuple[str, mf.PartRef]], progress: Progress | None = None
              ) -> dict[tuple[str, int], memoryview]:
        """Payloads of `refs` keyed by (object, offset), as views into the fetched ranges.

        Not yet checked: each part's sha256 is checked by the thread that decodes it, so hashing runs
        in parallel with other work and touches bytes while they are in cache. A whole-object hash
        would add nothing: every byte a reader uses lies in a part it checks.
        """
        by_object: dict[str, list[mf.PartRef]] = {}
        for _, r in refs:
            by_object.setdefault(r.object, []).append(r)
        sizes = self.manifest(version).objects
        jobs: list[tuple[str, int, int, list[mf.PartRef]]] = []
        for obj, parts in by_object.items():
            jobs.extend((obj, lo, hi, group) for lo, hi, group in ranged_gets(parts, self.range_bytes))

        def get(job: tuple[str, int, int, list[mf.PartRef]]) -> list[tuple[tuple[str, int], memoryview]]:
            obj, lo, hi, group = job
            key = mf.object_key(self.run, obj)
            whole = lo == 0 and hi == sizes.get(obj)
            data = memoryview(self.store.get(key) if whole else self.store.get(key, lo, hi))
            if progress is not None:
                progress(len(data))
            return [((obj, r.offset), data[r.offset - lo : r.offset - lo + r.length]) for r in group]

        if len(jobs) == 1:
            return dict(get(jobs[0]))
        return {k: v for chunk in self.pool.map(get, jobs) for k, v in chunk}

    # --- applying ---------------------------------------------------------------------------

    def decode(self, steps: list[Step], sizes: Mapping[str, int], progress: Progress | None = None
               ) -> dict[str, list[tuple[int, Decoded, mf.PartRef]]]:
        """Fetch, check and decode every part of the steps (in parallel); per tensor, in step order,
        as (version, decoded part, its reference)."""
        out: dict[str, list[tuple[int, Decoded, mf.PartRef]]] = {}
        for step in steps:
            refs = self.refs(step)
            payloads = self.fetch(step.version, refs, progress)
            decode = functools.partial(self._decode_one, step.version, payloads, sizes)
            for (name, r), d in zip(refs, self.pool.map(decode, refs), strict=True):
                out.setdefault(name, []).append((step.version, d, r))
        return out

    def entry(self, version: int, name: str) -> mf.TensorEntry:
        by_name = self._entries.get(version)
        if by_name is None:
            by_name = self._entries[version] = {t.name: t for t in self.manifest(version).tensors}
        return by_name[name]

    def check_part(self, version: int, payloads: Mapping[tuple[str, int], memoryview], sizes: Mapping[str, int],
                 item: tuple[str, mf.PartRef]) -> memoryview:
        """A part's bytes, once its range fits its tensor and its bytes match their sha256."""
        name, r = item
        payload = self.in_range(version, payloads, sizes, item)
        if len(payload) != r.length or hashlib.sha256(payload).hexdigest() != r.sha256:
            raise IntegrityError(f"{self.where(r)}: part of tensor {name} of version {version} does not "
                                 f"match its sha256")
        return payload

    def decode_checked(self, version: int, name: str, r: mf.PartRef, payload: memoryview) -> Decoded:
        try:
            return decode_part(payload, word_dtype(self.entry(version, name).dtype), r.stop - r.start)
        except CodecError as exc:
            raise IntegrityError(f"{self.where(r)}: tensor {name} of version {version}: {exc}") from exc

    def _decode_one(self, version: int, payloads: Mapping[tuple[str, int], memoryview], sizes: Mapping[str, int],
                    item: tuple[str, mf.PartRef]) -> Decoded:
        """Check one part's bytes against its sha256, then decode it (no tensor is touched)."""
        return self.decode_checked(version, item[0], item[1], self.check_part(version, payloads, sizes, item))

    def where(self, r: mf.PartRef) -> str:
        return f"{self.store.where(mf.object_key(self.run, r.object))} bytes {r.offset}+{r.length}"

    def apply(self, steps: list[Step], work: dict[str, np.ndarray], progress: Progress | None = None) -> None:
        """Apply the steps in order to the word arrays in `work` (private copies, mutated in place)."""
        for step in steps:
            decoded = self.decode([step], {n: w.size for n, w in work.items()}, progress)

            def run(name: str, decoded: dict[str, list[tuple[int, Decoded, mf.PartRef]]] = decoded) -> None:
                for _, d, r in decoded[name]:
                    apply_window(d, work[name][r.start : r.stop], 0)

            list(self.pool.map(run, list(decoded)))
            for t in self.manifest(step.version).tensors:
                if t.encoding == "tied" and t.name in work and t.tied_to in work:
                    work[t.name][...] = work[t.tied_to]

    def in_range(self, version: int, payloads: Mapping[tuple[str, int], memoryview], sizes: Mapping[str, int],
                  item: tuple[str, mf.PartRef]) -> memoryview:
        name, r = item
        if name not in sizes or not 0 <= r.start <= r.stop <= sizes[name]:
            raise IntegrityError(f"version {version} tensor {name}: part range {r.start}:{r.stop} "
                                 f"outside its {sizes.get(name)} elements")
        return payloads[(r.object, r.offset)]

    def check_changed(self, version: int, name: str, r: mf.PartRef, new: np.ndarray) -> None:
        self.check_digest(version, name, r, kernels.digest(new))

    def check_digest(self, version: int, name: str, r: mf.PartRef, digest: str) -> None:
        if r.changed_digest is None or digest != r.changed_digest:
            raise IntegrityError(f"{self.where(r)}: tensor {name} of version {version}: changed words do "
                                 f"not match their digest (is the state really the version it claims?); "
                                 f"nothing was applied")

    def apply_verified(self, decoded: dict[str, list[tuple[int, Decoded, mf.PartRef]]],
                       targets: dict[str, np.ndarray]) -> None:
        """Apply delta chains straight into `targets` (the caller's memory), after checking every word
        about to be written against its part's `changed_digest`; on any mismatch nothing is written.

        The chain is first folded into one sparse overlay per tensor (positions, final words), reading
        old words from `targets` and from earlier steps, so the check costs O(changes), not O(tensor).
        """
        names = sorted(decoded)
        overlays = dict(zip(names, self.pool.map(lambda n: self._overlay(n, decoded[n], targets[n]), names),
                            strict=True))

        def commit(name: str) -> None:
            pos, words = overlays[name]
            targets[name][pos] = words

        list(self.pool.map(commit, names))

    def _overlay(self, name: str, parts: list[tuple[int, Decoded, mf.PartRef]], target: np.ndarray
                 ) -> tuple[np.ndarray, np.ndarray]:
        ov_pos, ov_words = np.zeros(0, dtype=np.intp), np.zeros(0, dtype=target.dtype)
        for version, d, r in parts:
            if d.dense or d.pos is None:
                raise IntegrityError(f"{self.where(r)}: dense part of tensor {name} in a delta chain")
            pos = d.pos + r.start
            old = target[pos]
            if ov_pos.size:
                idx = np.minimum(np.searchsorted(ov_pos, pos), ov_pos.size - 1)
                hit = ov_pos[idx] == pos
                old[hit] = ov_words[idx[hit]]
            new = new_values(d.codec, old, d.words)
            self.check_changed(version, name, r, new)
            if not ov_pos.size:
                ov_pos, ov_words = pos, new
                continue
            merged, first = np.unique(np.concatenate([pos, ov_pos]), return_index=True)  # new words win
            ov_pos, ov_words = merged, np.concatenate([new, ov_words])[first]
        return ov_pos, ov_words

    def verify(self, version: int, work: dict[str, np.ndarray], names: set[str]) -> None:
        """Check the sha256 of each tensor in `names` against the manifest of `version`."""
        entries = {t.name: t for t in self.manifest(version).tensors}
        todo = sorted(names)
        digests = self.pool.map(lambda n: sha256_words(work[n]), todo)
        for name, digest in zip(todo, digests, strict=True):
            if digest != entries[name].sha256:
                raise IntegrityError(f"{self.store.where(mf.version_key(self.run, version))}: tensor {name} "
                                     f"has sha256 {digest[:16]}… after apply, manifest says "
                                     f"{entries[name].sha256[:16]}…")


def part_bytes(item: tuple[str, mf.PartRef] | tuple[str, mf.PartRef, memoryview]) -> int:
    return item[1].length


def empty_words(entry: mf.TensorEntry) -> np.ndarray:
    count = int(np.prod(entry.shape)) if entry.shape else 1
    if count < 0:
        raise HubError(f"tensor {entry.name} has a negative shape {entry.shape}")
    return np.zeros(count, dtype=word_dtype(entry.dtype))
