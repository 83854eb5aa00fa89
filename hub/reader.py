"""Reader: materializes a version from one store (rollout side of DESIGN.md §5).

A reader that holds version h and wants N applies the deltas h+1..N when that is on the chain and
cheaper in bytes than starting over; otherwise it starts from N's anchor. Parts are fetched with as
few GETs as possible (one ranged GET per run of neighbouring parts, the whole object when most of it
is needed), every part's sha256 is checked (by the thread that decodes it) before it is decoded.
From an anchor, parts are applied into private copies and every tensor's sha256 is checked before
anything reaches the caller. One version behind, in place (`apply_step_verified`), a compiled kernel
(kernels.py) writes each part's changes and checks them against the part's `changed_digest`, and on
any failure every written word is put back; either way an error never leaves a half-applied state
dict behind.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import itertools
import struct
import sys
import threading
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import Executor
from dataclasses import dataclass
from typing import Any

import numpy as np
import zstandard

from fleetrl.hub import kernels
from fleetrl.hub import manifest as mf
from fleetrl.hub import streams as st
from fleetrl.hub.batching import RANGE_FRAMES, balanced, ranged_gets
from fleetrl.hub.errors import CodecError, HubError, IntegrityError
from fleetrl.hub.parts import Decoded, Header, apply_window, decode_part, split_part
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
        self._threads = max(1, threads)

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

    def _refs(self, step: Step) -> list[tuple[str, mf.PartRef]]:
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
        names = {name for step in steps for name, _ in self._refs(step)}
        for step in steps:
            names.update(t.name for t in self.manifest(step.version).tensors if t.encoding == "tied")
        return names

    def _delta_chain(self, have: int, version: int) -> list[Step] | None:
        """Deltas have+1..version, or None when some version lacks one (e.g. the very first anchor)."""
        if not 0 <= version - have <= self.anchor_interval:
            return None
        steps = []
        for v in range(have + 1, version + 1):
            m = self.manifest(v)
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
        return sum(r.length for s in steps for _, r in self._refs(s))

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
            refs = self._refs(step)
            payloads = self.fetch(step.version, refs, progress)
            decode = functools.partial(self._decode_one, step.version, payloads, sizes)
            for (name, r), d in zip(refs, self.pool.map(decode, refs), strict=True):
                out.setdefault(name, []).append((step.version, d, r))
        return out

    def _entry(self, version: int, name: str) -> mf.TensorEntry:
        by_name = self._entries.get(version)
        if by_name is None:
            by_name = self._entries[version] = {t.name: t for t in self.manifest(version).tensors}
        return by_name[name]

    def _checked(self, version: int, payloads: Mapping[tuple[str, int], memoryview], sizes: Mapping[str, int],
                 item: tuple[str, mf.PartRef]) -> memoryview:
        """A part's bytes, once its range fits its tensor and its bytes match their sha256."""
        name, r = item
        payload = self._in_range(version, payloads, sizes, item)
        if len(payload) != r.length or hashlib.sha256(payload).hexdigest() != r.sha256:
            raise IntegrityError(f"{self._where(r)}: part of tensor {name} of version {version} does not "
                                 f"match its sha256")
        return payload

    def _decode_checked(self, version: int, name: str, r: mf.PartRef, payload: memoryview) -> Decoded:
        try:
            return decode_part(payload, word_dtype(self._entry(version, name).dtype), r.stop - r.start)
        except CodecError as exc:
            raise IntegrityError(f"{self._where(r)}: tensor {name} of version {version}: {exc}") from exc

    def _decode_one(self, version: int, payloads: Mapping[tuple[str, int], memoryview], sizes: Mapping[str, int],
                    item: tuple[str, mf.PartRef]) -> Decoded:
        """Check one part's bytes against its sha256, then decode it (no tensor is touched)."""
        return self._decode_checked(version, item[0], item[1], self._checked(version, payloads, sizes, item))

    def _where(self, r: mf.PartRef) -> str:
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

    def apply_step_verified(self, step: Step, targets: dict[str, np.ndarray], progress: Progress | None = None
                            ) -> None:
        """Apply one delta step straight into `targets` (the caller's memory): the common case of a
        reader one version behind.

        The parts are cut into batches, and every thread (the caller's and the pool's) takes the
        next task: apply a prepared batch if there is one, else prepare the next (check each part's
        sha256, split it, zstd its streams into one buffer). Applying is bound by memory traffic and
        preparing by the CPU, so the two overlap. Parts of the common codecs go through the fused
        kernel (kernels.py: one pass that writes each changed word in place and folds it into the
        part's digest), the others through numpy (gather the old words, compute the new, scatter).
        Either way the new words are checked against the part's `changed_digest` (is the state
        really version N-1?).

        Every write is recorded, so when any part fails every written word is put back before the
        error is raised: the caller's state is then bit for bit what it was. Parts of a tensor must
        not overlap (checked first), so batches are applied in any order and putting back is
        order-free.
        """
        version = step.version
        refs = self._refs(step)
        mf.check_disjoint(refs, self.store.where(mf.version_key(self.run, version)))
        payloads = self.fetch(version, refs, progress)
        sizes = {n: t.size for n, t in targets.items()}
        # Twice as many batches, the first two (one per thread) kept small and the rest paired, so
        # that writing starts after half a batch's preparation.
        halves = balanced(refs, 2 * PIPELINE_BATCHES, _part_bytes)
        halves.sort(key=lambda batch: sum(r.length for _, r in batch))
        none: list[tuple[str, mf.PartRef]] = []
        batches = halves[:2] + [a + b for a, b in itertools.zip_longest(halves[2::2], halves[3::2], fillvalue=none)]
        work = _Work(len(batches))

        def run() -> None:
            while (task := work.next()) is not None:
                k, item = task
                try:
                    if item is None:
                        work.prepared(self._prepare(version, payloads, sizes, targets, batches[k]))
                    else:
                        undo: list[Callable[[], None]] = []
                        try:
                            self._apply_prepared(version, item, targets, undo)
                        finally:
                            work.applied(undo)
                except BaseException as exc:
                    work.fail(exc)

        with _short_gil_turns():
            helpers = [self.pool.submit(run) for _ in range(self._threads - 1)]
            run()
            for helper in helpers:
                helper.result()
        if work.error is not None:
            for put_back in reversed(work.undo):
                put_back()
            raise work.error

    def _prepare(self, version: int, payloads: Mapping[tuple[str, int], memoryview], sizes: Mapping[str, int],
                 targets: dict[str, np.ndarray], batch: list[tuple[str, mf.PartRef]]) -> _Prepared:
        """A batch made ready to apply, nothing written: every part checked against its sha256, parts
        for the kernel decompressed together into one buffer per word dtype, the others kept
        as bytes."""
        fused: dict[np.dtype, tuple[kernels.Batch, list[_Fused]]] = {}
        others: list[tuple[str, mf.PartRef, memoryview]] = []
        for name, r in batch:
            payload = self._checked(version, payloads, sizes, (name, r))
            try:
                head, frames = split_part(payload)
            except CodecError as exc:
                raise IntegrityError(f"{self._where(r)}: tensor {name} of version {version}: {exc}") from exc
            dtype = word_dtype(self._entry(version, name).dtype)
            if kernels.eligible(head, dtype) and targets[name].dtype == dtype:
                if dtype not in fused:
                    fused[dtype] = (kernels.Batch(), [])
                fused[dtype][1].append((name, r, head, frames))
            else:
                others.append((name, r, payload))
        for group, members in fused.values():
            self._decompress_into(version, group, members, targets)
            group.seal()
        return fused, others

    def _apply_prepared(self, version: int, prepared: _Prepared, targets: dict[str, np.ndarray],
                        undo: list[Callable[[], None]]) -> None:
        fused, others = prepared
        for name, r, payload in others:
            self._apply_numpy(version, name, r, payload, targets[name], undo)
        for group, members in fused.values():
            undo.append(group.undo)
            digests, at, error = group.apply()
            if error is not None:
                name, r, _, _ = members[at]
                raise IntegrityError(f"{self._where(r)}: tensor {name} of version {version}: {error}")
            for (name, r, _, _), digest in zip(members, digests, strict=True):
                self._check_digest(version, name, r, digest)

    def _decompress_into(self, version: int, group: kernels.Batch,
                         members: list[_Fused],
                         targets: dict[str, np.ndarray]) -> None:
        """Every frame of the members in one zstd call (fewer hand-overs of the GIL), into `group`;
        when that fails, part by part, to name the part at fault."""
        frames = [frame for _, _, _, fr in members for frame, _ in fr]
        raw = [size for _, _, _, fr in members for _, size in fr]
        try:
            out = zstandard.ZstdDecompressor().multi_decompress_to_buffer(
                list[bytes | bytearray | memoryview](frames), decompressed_sizes=struct.pack(f"={len(raw)}Q", *raw),
                threads=1)
            segments: list[Any] = [out[i] for i in range(len(raw))]
            if any(len(seg) != size for seg, size in zip(segments, raw, strict=True)):
                raise zstandard.ZstdError("a frame holds another number of bytes than its header says")
        except zstandard.ZstdError:
            segments = []
            for name, r, _, fr in members:
                try:
                    segments += [st.decompress(frame, size) for frame, size in fr]
                except CodecError as exc:
                    raise IntegrityError(f"{self._where(r)}: tensor {name} of version {version}: {exc}") from exc
        at = 0
        for name, r, head, fr in members:
            group.add(targets[name], r.start, r.stop, head[5], segments[at : at + len(fr)], raw[at : at + len(fr)])
            at += len(fr)

    def _in_range(self, version: int, payloads: Mapping[tuple[str, int], memoryview], sizes: Mapping[str, int],
                  item: tuple[str, mf.PartRef]) -> memoryview:
        name, r = item
        if name not in sizes or not 0 <= r.start <= r.stop <= sizes[name]:
            raise IntegrityError(f"version {version} tensor {name}: part range {r.start}:{r.stop} "
                                 f"outside its {sizes.get(name)} elements")
        return payloads[(r.object, r.offset)]

    def _apply_numpy(self, version: int, name: str, r: mf.PartRef, payload: memoryview, words: np.ndarray,
                     undo: list[Callable[[], None]]) -> None:
        """The per-part numpy path, for parts of the less common codecs (their bytes are checked)."""
        d = self._decode_checked(version, name, r, payload)
        if d.dense or d.pos is None:
            raise IntegrityError(f"{self._where(r)}: dense part of tensor {name} in a delta step")
        view = words[r.start : r.stop]
        old = np.take(view, d.pos)
        new = new_values(d.codec, old, d.words)
        self._check_changed(version, name, r, new)
        view[d.pos] = new
        undo.append(functools.partial(view.__setitem__, d.pos, old))

    def _check_changed(self, version: int, name: str, r: mf.PartRef, new: np.ndarray) -> None:
        self._check_digest(version, name, r, kernels.digest(new))

    def _check_digest(self, version: int, name: str, r: mf.PartRef, digest: str) -> None:
        if r.changed_digest is None or digest != r.changed_digest:
            raise IntegrityError(f"{self._where(r)}: tensor {name} of version {version}: changed words do "
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
                raise IntegrityError(f"{self._where(r)}: dense part of tensor {name} in a delta chain")
            pos = d.pos + r.start
            old = target[pos]
            if ov_pos.size:
                idx = np.minimum(np.searchsorted(ov_pos, pos), ov_pos.size - 1)
                hit = ov_pos[idx] == pos
                old[hit] = ov_words[idx[hit]]
            new = new_values(d.codec, old, d.words)
            self._check_changed(version, name, r, new)
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


_Fused = tuple[str, mf.PartRef, Header, list[tuple[memoryview, int]]]
"""A part for the kernel: tensor, reference, header, (zstd frame, raw size) of each stream."""
_Prepared = tuple[dict[np.dtype, tuple[kernels.Batch, list[_Fused]]], list[tuple[str, mf.PartRef, memoryview]]]
"""A batch ready to apply: kernel groups per word dtype, and the parts for numpy."""
PIPELINE_BATCHES = 8
"""Batches of an in-place step: small enough that applying starts early and never waits long for
the next, large enough that the per-batch Python is noise."""


_turns_lock = threading.Lock()
_turns_users = 0
_turns_before = 0.0


@contextlib.contextmanager
def _short_gil_turns() -> Iterator[None]:
    """Hand the GIL over every 0.2 ms instead of every 5 ms while a step runs. Its threads spend
    most of their time in C (kernel, zstd, sha256) and need the GIL only briefly in between; with
    the default interval, a thread coming back from C could wait 5 ms for a thread running Python
    (measured: three such waits in one 15 ms step). The interval is process-wide: the first of
    overlapping steps shortens it and the last one puts it back."""
    global _turns_users, _turns_before
    with _turns_lock:
        if _turns_users == 0:
            _turns_before = sys.getswitchinterval()
            sys.setswitchinterval(min(_turns_before, 0.0002))
        _turns_users += 1
    try:
        yield
    finally:
        with _turns_lock:
            _turns_users -= 1
            if _turns_users == 0:
                sys.setswitchinterval(_turns_before)


class _Work:
    """The tasks of one in-place step, shared by its threads: prepare batch k, or apply a prepared one."""

    def __init__(self, count: int) -> None:
        self._cond = threading.Condition()
        self._count = count
        self._next = 0
        self._ready: list[_Prepared] = []
        self._applied = 0
        self._applying = 0
        self.undo: list[Callable[[], None]] = []
        self.error: BaseException | None = None

    def next(self) -> tuple[int, _Prepared | None] | None:
        """A task: (batch, None) to prepare, (-1, prepared batch) to apply; None when all is done or failed.

        One thread applies at a time while batches are left to prepare (applying is bound by memory
        traffic: a second writer gains little, and a preparing thread overlaps it fully)."""
        with self._cond:
            while True:
                if self.error is not None or self._applied == self._count:
                    return None
                if self._ready and (self._applying == 0 or self._next == self._count):
                    self._applying += 1
                    return -1, self._ready.pop()
                if self._next < self._count:
                    self._next += 1
                    return self._next - 1, None
                self._cond.wait(timeout=1.0)  # another thread is preparing the last batches

    def prepared(self, item: _Prepared) -> None:
        with self._cond:
            self._ready.append(item)
            self._cond.notify()

    def applied(self, undo: list[Callable[[], None]]) -> None:
        with self._cond:
            self._applying -= 1
            self._applied += 1
            self.undo += undo
            self._cond.notify_all()

    def fail(self, exc: BaseException) -> None:
        with self._cond:
            if self.error is None:
                self.error = exc
            self._cond.notify_all()



def _part_bytes(item: tuple[str, mf.PartRef] | tuple[str, mf.PartRef, memoryview]) -> int:
    return item[1].length


def empty_words(entry: mf.TensorEntry) -> np.ndarray:
    count = int(np.prod(entry.shape)) if entry.shape else 1
    if count < 0:
        raise HubError(f"tensor {entry.name} has a negative shape {entry.shape}")
    return np.zeros(count, dtype=word_dtype(entry.dtype))
