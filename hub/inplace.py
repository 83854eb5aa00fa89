"""Applying one delta step in place: the common case of a rollout node one version behind.

`apply_step(reader, step, targets)` writes version N's changes straight into `targets` (the caller's
word arrays, holding N-1). The parts are cut into batches, and every thread (the caller's and the
reader's pool) takes the next task: apply a prepared batch if there is one, else prepare the next
(check each part's sha256, split it, decode its zstd frames into one buffer). Applying is bound by
memory traffic and preparing by the CPU, so the two overlap. Parts of the common codecs go through
the compiled kernel (kernels.py: one pass that writes each changed word in place and folds it into
the part's digest), the others through numpy (gather the old words, compute the new, scatter).
Either way the new words are checked against the part's `changed_digest` (is the state really
version N-1?).

With `record`, each change's flat position and new word are written out in the same pass (the
kernel's, or numpy's for the other parts) and returned per tensor: what an engine that scatters
changes into its own copy needs, without a second decode of the positions or a gather.

Every write is recorded, so when any part fails every written word is put back before the error is
raised: the caller's state is then bit for bit what it was. Parts of a tensor must not overlap
(checked first), so batches are applied in any order and putting back is order-free.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import struct
import sys
import threading
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import numpy as np
import zstandard

from fleetrl.hub import kernels
from fleetrl.hub import manifest as mf
from fleetrl.hub import streams as st
from fleetrl.hub.batching import balanced
from fleetrl.hub.errors import CodecError, IntegrityError
from fleetrl.hub.parts import Header, split_part
from fleetrl.hub.reader import Progress, Reader, Step, part_bytes
from fleetrl.hub.streams import new_values
from fleetrl.hub.tensors import word_dtype

BATCHES = 8
"""Batches of a step: small enough that applying starts early and never waits long for the next,
large enough that the per-batch Python is noise."""

_Undo = list[Callable[[], None]]
_Fused = tuple[str, mf.PartRef, Header, list[tuple[memoryview, int]]]
"""A part for the kernel: tensor, reference, header, (zstd frame, raw size) of each stream."""
_Prepared = tuple[dict[np.dtype, tuple[kernels.Batch, list[_Fused]]], list[tuple[str, mf.PartRef, memoryview]]]
"""A batch ready to apply: kernel groups per word dtype, and the parts for numpy."""


def apply_step(reader: Reader, step: Step, targets: dict[str, np.ndarray], progress: Progress | None = None,
               record: bool = False) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """Apply delta `step` into `targets` (the caller's memory); on any error nothing is changed.
    With `record`, returns per changed tensor the flat positions of its changed words (int64,
    increasing) and the new words (of the target's word dtype); else an empty dict."""
    refs = reader.refs(step)
    mf.check_disjoint(refs, reader.store.where(mf.version_key(reader.run, step.version)))
    payloads = reader.fetch(step.version, refs, progress)
    state = _InPlace(reader, step.version, payloads, targets, record)
    state.run(_batches(refs), reader.threads)
    return state.changes() if record else {}


def _batches(refs: list[tuple[str, mf.PartRef]]) -> list[list[tuple[str, mf.PartRef]]]:
    """BATCHES batches of about equal bytes, and before them two of half that (one per thread), so
    that writing starts after half a batch's preparation."""
    halves = balanced(refs, 2 * BATCHES, part_bytes)
    halves.sort(key=lambda batch: sum(r.length for _, r in batch))
    none: list[tuple[str, mf.PartRef]] = []
    return halves[:2] + [a + b for a, b in itertools.zip_longest(halves[2::2], halves[3::2], fillvalue=none)]


class _InPlace:
    """One step's state, shared by its threads."""

    def __init__(self, reader: Reader, version: int, payloads: Mapping[tuple[str, int], memoryview],
                 targets: dict[str, np.ndarray], record: bool = False) -> None:
        self.reader, self.version, self.payloads, self.targets = reader, version, payloads, targets
        self.sizes = {n: t.size for n, t in targets.items()}
        self.record = record
        self.records: dict[tuple[str, int], tuple[np.ndarray, np.ndarray]] = {}
        """(tensor, part start) -> positions and new words of the part's changes (with `record`)."""

    def changes(self) -> dict[str, tuple[np.ndarray, np.ndarray]]:
        """The recorded changes per tensor, its parts in order (parts are disjoint ranges). A tensor of
        several parts is joined on the reader's threads, tensors side by side (numpy copies without the
        GIL): joined one after another, a 0.5 B model's 19 M changes took ~50 ms of an update's ~107 ms
        of host time on an H200's host."""
        by_tensor: dict[str, list[tuple[int, tuple[np.ndarray, np.ndarray]]]] = {}
        for (name, start), rec in self.records.items():
            by_tensor.setdefault(name, []).append((start, rec))
        out = {name: parts[0][1] for name, parts in by_tensor.items() if len(parts) == 1}
        several = [(name, sorted(parts, key=lambda item: item[0])) for name, parts in by_tensor.items()
                   if len(parts) > 1]

        def join(parts: list[tuple[int, tuple[np.ndarray, np.ndarray]]]) -> tuple[np.ndarray, np.ndarray]:
            return np.concatenate([r[0] for _, r in parts]), np.concatenate([r[1] for _, r in parts])

        joined = self.reader.pool.map(join, [parts for _, parts in several]) if len(several) > 1 else \
            map(join, [parts for _, parts in several])
        out.update(zip((name for name, _ in several), joined, strict=True))
        return {name: out[name] for name in by_tensor}  # in the order the parts were recorded, as before

    def run(self, batches: list[list[tuple[str, mf.PartRef]]], threads: int) -> None:
        work = _Work(len(batches))

        def worker() -> None:
            while (task := work.next()) is not None:
                k, item = task
                try:
                    if item is None:
                        work.prepared(self.prepare(batches[k]))
                    else:
                        undo: _Undo = []
                        try:
                            self.apply(item, undo)
                        finally:
                            work.applied(undo)
                except BaseException as exc:
                    work.fail(exc)

        with _short_gil_turns():
            helpers = [self.reader.pool.submit(worker) for _ in range(threads - 1)]
            worker()
            for helper in helpers:
                helper.result()
        if work.error is not None:
            for put_back in reversed(work.undo):
                put_back()
            raise work.error

    def _fail(self, name: str, r: mf.PartRef, why: object) -> IntegrityError:
        return IntegrityError(f"{self.reader.where(r)}: tensor {name} of version {self.version}: {why}")

    def prepare(self, batch: list[tuple[str, mf.PartRef]]) -> _Prepared:
        """A batch made ready to apply, nothing written: every part checked against its sha256, parts
        for the kernel decompressed together into one buffer per word dtype, the others kept as
        bytes."""
        fused: dict[np.dtype, tuple[kernels.Batch, list[_Fused]]] = {}
        others: list[tuple[str, mf.PartRef, memoryview]] = []
        for name, r in batch:
            payload = self.reader.check_part(self.version, self.payloads, self.sizes, (name, r))
            try:
                head, frames = split_part(payload)
            except CodecError as exc:
                raise self._fail(name, r, exc) from exc
            dtype = word_dtype(self.reader.entry(self.version, name).dtype)
            if kernels.eligible(head, dtype) and self.targets[name].dtype == dtype:
                if dtype not in fused:
                    fused[dtype] = (kernels.Batch(), [])
                fused[dtype][1].append((name, r, head, frames))
            else:
                others.append((name, r, payload))
        for group, members in fused.values():
            self._decompress_into(group, members)
            group.seal()
        return fused, others

    def apply(self, prepared: _Prepared, undo: _Undo) -> None:
        fused, others = prepared
        for name, r, payload in others:
            self._apply_numpy(name, r, payload, undo)
        for group, members in fused.values():
            undo.append(group.undo)
            digests, at, error = group.apply()
            if error is not None:
                name, r, _, _ = members[at]
                raise self._fail(name, r, error)
            for (name, r, _, _), digest in zip(members, digests, strict=True):
                self.reader.check_digest(self.version, name, r, digest)

    def _decompress_into(self, group: kernels.Batch, members: list[_Fused]) -> None:
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
                    raise self._fail(name, r, exc) from exc
        at = 0
        for name, r, head, fr in members:
            record = group.add(self.targets[name], r.start, r.stop, head[5], segments[at : at + len(fr)],
                               raw[at : at + len(fr)], record=self.record)
            if record is not None:
                self.records[(name, r.start)] = record
            at += len(fr)

    def _apply_numpy(self, name: str, r: mf.PartRef, payload: memoryview, undo: _Undo) -> None:
        """The per-part numpy path, for parts of the less common codecs (their bytes are checked)."""
        d = self.reader.decode_checked(self.version, name, r, payload)
        if d.dense or d.pos is None:
            raise IntegrityError(f"{self.reader.where(r)}: dense part of tensor {name} in a delta step")
        view = self.targets[name][r.start : r.stop]
        old = np.take(view, d.pos)
        new = new_values(d.codec, old, d.words)
        self.reader.check_changed(self.version, name, r, new)
        view[d.pos] = new
        undo.append(functools.partial(view.__setitem__, d.pos, old))
        if self.record:
            self.records[(name, r.start)] = (d.pos.astype(np.int64) + r.start, np.asarray(new, dtype=view.dtype))


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
        self.undo: _Undo = []
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

    def applied(self, undo: _Undo) -> None:
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
