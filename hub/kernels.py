"""Compiled kernels of the in-place delta reader: decode, apply and check a part's changes in one pass.

At RL learning rates a delta touches about half of the model's cache lines, so applying one is bound
by memory traffic, and every extra pass over the changes (numpy's widen, cumsum, gather, add,
scatter: each over an 8-byte index array as long as the changes) costs as much again. The kernel
here walks the gap bytes once: it advances the position, unpacks the difference from its 1, 2 or
4-bit table index (or its escape), adds it to the old word in place and folds the new word into the
part's changed-words digest (`digest`), which the caller compares with the manifest's. A batch of
parts goes through one call (`Batch`), so Python is not paid per part. It is compiled by numba
(`nogil`, so the reader's threads run it in parallel) and cached on disk after the first compile.
That compile takes seconds (a GPU node's first delta waited 7.7 s for it; every signature takes
6 s on a 2-core machine, 9-15 s on a lent H200's) and a fresh node has no cache yet: `warm_up`
compiles every signature the reader uses ahead of time (the benchmarks call it before timing).

Everything is integer arithmetic on bit patterns, wrapping at the word width (a store truncates), so
the exact inverse is the same walk subtracting: `Batch.undo` puts back every change written when a
check fails. Words of 2 or 4 bytes are supported (every difference and escape fits an int64
exactly); anything else takes the numpy path of `parts.py`.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import Any, no_type_check

import numba
import numpy as np
from llvmlite import binding as llvm
from llvmlite import ir
from numba.core import cgutils, types
from numba.extending import intrinsic

from fleetrl.hub import streams as st

PREFETCH_BYTES = 16384
"""How far ahead of the current position the kernel asks for the target's cache lines. Changes are
spread over the whole model, so the walk crosses a 4 KiB page every few dozen changes, and the
hardware prefetcher stops at page boundaries: without a hint each new page starts with a full miss
(measured on a 2-vCPU EPYC: 40% of the walk's time)."""

OK = 0
ERRORS = {
    1: "a large gap is missing from its side stream",
    2: "positions run past their part",
    3: "an escaped value is missing from its side stream",
    4: "stray large gaps or escaped values after the last change",
    5: "the gap stream does not hold one gap per change",
    6: "the packed values need a table of words and 1, 2 or 4-bit indices",
    7: "the packed index stream is too short, or the table too long",
    8: "the arrays that record the changes do not hold one element per change",
}

_PREFETCH = "llvm.prefetch.p0" if llvm.llvm_version_info[0] >= 15 else "llvm.prefetch.p0i8"  # opaque pointers


@intrinsic
@no_type_check  # compiled: numba types the body, not mypy
def _prefetch(typingctx: object, array: types.Array, index: types.Integer) -> tuple[object, object]:  # pragma: no cover
    """Hint that `array[index]` will be written soon (LLVM's prefetch: write, high locality, data)."""
    def codegen(context: object, builder: ir.IRBuilder, signature: object, args: tuple[object, object]) -> object:
        view = context.make_array(array)(context, builder, args[0])
        ptr = cgutils.get_item_pointer(context, builder, array, view, [args[1]], wraparound=False)
        byte_ptr = ir.IntType(8).as_pointer()
        i32 = ir.IntType(32)
        fn = cgutils.get_or_insert_function(
            builder.module, ir.FunctionType(ir.VoidType(), [byte_ptr, i32, i32, i32]), _PREFETCH)
        builder.call(fn, [builder.bitcast(ptr, byte_ptr), i32(1), i32(3), i32(1)])
        return context.get_dummy_value()
    return types.void(array, index), codegen


@intrinsic
@no_type_check  # compiled: numba types the body, not mypy
def _pointer(typingctx, address, like):  # pragma: no cover
    """`address` (an int64) as a pointer to words of `like`'s dtype."""
    pointer = types.CPointer(like.dtype)

    def codegen(context, builder, signature, args):
        return builder.inttoptr(args[0], context.get_value_type(pointer))
    return pointer(address, like), codegen


@numba.njit(nogil=True, cache=True, boundscheck=False, inline="always")
@no_type_check  # compiled: numba types the body, not mypy
def _unzigzag(z: int) -> int:  # pragma: no cover - compiled
    """The wrapping difference a zigzagged word stands for (streams._unzigzag, on one int64)."""
    return (z >> 1) ^ -(z & 1)


@numba.njit(nogil=True, cache=True, boundscheck=False, inline="always")
@no_type_check  # compiled: numba types the body, not mypy
def _word(data: np.ndarray, at: int, width: int) -> int:  # pragma: no cover - compiled
    """The little-endian unsigned word of `width` bytes at byte `at`."""
    v = np.int64(0)
    for b in range(width):
        v |= np.int64(data[at + b]) << (8 * b)
    return v


_KEY = np.uint64(0x9E3779B97F4A7C15)
_MUL = np.uint64(0xBF58476D1CE4E5B9)


@numba.njit(nogil=True, cache=True, boundscheck=False, inline="always")
@no_type_check  # compiled: numba types the body, not mypy
def _mix(i: int, v: int) -> np.uint64:  # pragma: no cover - compiled
    """A 64-bit mix of (index, word): xor a key, multiply by an odd constant, xor-shift (each step a
    bijection, so two different (index, word) pairs never mix to the same value)."""
    x = ((np.uint64(i) << np.uint64(32)) | np.uint64(v)) ^ _KEY
    x *= _MUL
    return x ^ (x >> np.uint64(31))


@numba.njit(nogil=True, cache=True, boundscheck=False)
@no_type_check  # compiled: numba types the body, not mypy
def _digest(words: np.ndarray) -> np.uint64:  # pragma: no cover - compiled
    h = np.uint64(0)
    for i in range(words.size):
        h += _mix(i, words[i])
    return h


def digest(words: np.ndarray) -> str:
    """The changed-words digest of a part: the sum mod 2**64 of `_mix(i, word_i)` over its new words
    in order, as 16 hex digits (2 or 4-byte words; 8-byte ones are digested as pairs of 4-byte
    halves, 1-byte ones as they are).

    Not a cryptographic hash, and it need not be one: the part's bytes are authenticated by their
    sha256 in the signed manifest, so the words the kernel writes are the publisher's. What this
    catches is a reader whose state is not the version it claims (an accident: a wrong
    `have_version`, weights changed behind the hub's back): any one wrong word changes the sum, and
    several slip through with probability about 2**-64. The kernel computes it in the pass that
    writes the words (a sha256 of them cost a third of the whole in-place update).
    """
    flat = np.ascontiguousarray(words).reshape(-1)
    if flat.dtype.itemsize == 8 or flat.dtype.itemsize == 1:
        flat = np.ascontiguousarray(flat.astype(flat.dtype.newbyteorder("<"), copy=False)).view(
            "<u4" if flat.dtype.itemsize == 8 else "u1")
    return f"{int(_digest(flat)):016x}"


@numba.njit(nogil=True, cache=True, boundscheck=False, inline="always")
@no_type_check  # compiled: numba types the body, not mypy
def _loop(target: np.ndarray, p: int, last: int, gaps: np.ndarray, bigs: np.ndarray, table: np.ndarray,
          packed: np.ndarray, rest: np.ndarray, limit: int, ahead: int, bits: int, sign: int,
          out_pos: np.ndarray, out_words: np.ndarray, record: int) -> tuple[int, int, np.uint64]:  # pragma: no cover
    """The walk proper, inlined with `bits`, `sign` and `record` as constants. Positions need no check
    here: `_walk` proved that the last one lies in the part. With `record`, change i's position and
    new word also go to `out_pos[i]` and `out_words[i]` (what an engine that scatters needs)."""
    width = target.itemsize
    per_shift = 3 if bits == 1 else (2 if bits == 2 else 1)
    lane = (1 << per_shift) - 1
    mask = (1 << bits) - 1
    n_rest = rest.size // width
    h = np.uint64(0)
    nb = 0
    ne = 0
    for i in range(limit):
        g = gaps[i]
        if g == 255:
            p += _word(bigs, 4 * nb, 4) + 1
            nb += 1
        else:
            p += np.int64(g) + 1
        _prefetch(target, min(p + ahead, last))
        d = table[(np.int64(packed[i >> per_shift]) >> ((i & lane) * bits)) & mask]
        if d == 0:  # the escape slot (a changed word never differs by 0)
            if ne >= n_rest:
                return 3, i, h
            z = _word(rest, width * ne, width)
            ne += 1
            d = _unzigzag(z)
        if sign > 0:
            target[p] = np.int64(target[p]) + d
            h += _mix(i, target[p])
            if record:
                out_pos[i] = p
                out_words[i] = target[p]
        else:
            target[p] = np.int64(target[p]) - d
    if sign > 0 and limit == gaps.size and ne != n_rest:
        return 4, limit, h
    return 0, limit, h


@numba.njit(nogil=True, cache=True, boundscheck=False)
@no_type_check  # compiled: numba types the body, not mypy
def _walk(target: np.ndarray, start: int, stop: int, m: int, gaps: np.ndarray, bigs: np.ndarray,
          table_head: np.ndarray, packed: np.ndarray, rest: np.ndarray, limit: int, sign: int, ahead: int,
          out_pos: np.ndarray, out_words: np.ndarray) -> tuple[int, int, np.uint64]:  # pragma: no cover - compiled
    """Apply (sign 1) or take back (sign -1) the first `limit` of the part's `m` changes; returns
    (error code, changes written, the digest of the new words). Applying records each change's
    position and new word in `out_pos` and `out_words` when they hold `m` elements (else they are
    empty and nothing is recorded).

    The streams are the part's raw bytes (parts.py): gap bytes (255: the gap is the next uint32 of
    `bigs`), the table (index width, then zigzagged differences as words), packed indices (the last
    slot of a full table, or any slot past the table, is the escape: the next zigzagged word of
    `rest`). Before a word is written, the counts are checked and the last position is computed
    (one pass over the gap bytes, which vectorizes): positions increase, so if the last one lies in
    the part, every one does, and the walk needs no check per change."""
    width = target.itemsize
    h = np.uint64(0)
    if gaps.size != m or bigs.size % 4 != 0 or rest.size % width != 0 or not 0 <= start <= stop <= target.size:
        return 5, 0, h
    if table_head.size < 1 or (table_head.size - 1) % width != 0:
        return 6, 0, h
    bits = np.int64(table_head[0])
    if bits != 1 and bits != 2 and bits != 4:
        return 6, 0, h
    per_shift = 3 if bits == 1 else (2 if bits == 2 else 1)
    if (table_head.size - 1) // width > (1 << bits) or packed.size << per_shift < m:
        return 7, 0, h
    table = np.zeros(16, dtype=np.int64)  # unzigzagged differences; 0 marks the escape
    for j in range((table_head.size - 1) // width):
        z = _word(table_head, 1 + j * width, width)
        table[j] = _unzigzag(z)
    total = np.int64(0)
    escapes = np.int64(0)
    for i in range(m):
        total += np.int64(gaps[i])
        escapes += np.int64(gaps[i] == 255)
    n_big = bigs.size // 4
    if escapes != n_big:
        return 1 if escapes > n_big else 4, 0, h
    for j in range(n_big):
        total += _word(bigs, 4 * j, 4) - 255
    last = np.int64(start) - 1 + total + m
    if m and last >= stop:
        return 2, 0, h
    if out_pos.size != 0 and (out_pos.size != m or out_words.size != m):
        return 8, 0, h
    p = np.int64(start) - 1
    o, w = out_pos, out_words
    if sign > 0 and out_pos.size != 0:
        if bits == 4:
            return _loop(target, p, last, gaps, bigs, table, packed, rest, limit, ahead, 4, 1, o, w, 1)
        if bits == 2:
            return _loop(target, p, last, gaps, bigs, table, packed, rest, limit, ahead, 2, 1, o, w, 1)
        return _loop(target, p, last, gaps, bigs, table, packed, rest, limit, ahead, 1, 1, o, w, 1)
    if sign > 0:
        if bits == 4:
            return _loop(target, p, last, gaps, bigs, table, packed, rest, limit, ahead, 4, 1, o, w, 0)
        if bits == 2:
            return _loop(target, p, last, gaps, bigs, table, packed, rest, limit, ahead, 2, 1, o, w, 0)
        return _loop(target, p, last, gaps, bigs, table, packed, rest, limit, ahead, 1, 1, o, w, 0)
    if bits == 4:
        return _loop(target, p, last, gaps, bigs, table, packed, rest, limit, ahead, 4, -1, o, w, 0)
    if bits == 2:
        return _loop(target, p, last, gaps, bigs, table, packed, rest, limit, ahead, 2, -1, o, w, 0)
    return _loop(target, p, last, gaps, bigs, table, packed, rest, limit, ahead, 1, -1, o, w, 0)


@numba.njit(nogil=True, cache=True, boundscheck=False)
@no_type_check  # compiled: numba types the body, not mypy
def _walk_parts(like: np.ndarray, targets: np.ndarray, buf: np.ndarray, meta: np.ndarray, limits: np.ndarray,
                sign: int, ahead: int, digests: np.ndarray) -> tuple[int, int, int]:  # pragma: no cover - compiled
    """`_walk` over parts; row j of `meta`: target index, start, stop, m, then offset and length in
    `buf` of each of the five streams, then the addresses of the part's records of positions (int64)
    and new words (0: none). Target t is the `targets[t, 1]` words (of `like`'s dtype) at address
    `targets[t, 0]`. Returns (error code, part at fault, changes of it written)."""
    for j in range(meta.shape[0]):
        row = meta[j]
        target = numba.carray(_pointer(targets[row[0], 0], like), targets[row[0], 1])
        n_out = row[3] if row[14] != 0 else 0
        out_pos = numba.carray(_pointer(row[14] if n_out else targets[row[0], 0], limits), n_out)
        out_words = numba.carray(_pointer(row[15] if n_out else targets[row[0], 0], like), n_out)
        code, written, h = _walk(
            target, row[1], row[2], row[3], buf[row[4] : row[4] + row[5]], buf[row[6] : row[6] + row[7]],
            buf[row[8] : row[8] + row[9]], buf[row[10] : row[10] + row[11]], buf[row[12] : row[12] + row[13]],
            limits[j], sign, ahead, out_pos, out_words)
        digests[j] = h
        if code != 0:
            return code, j, written
    return 0, meta.shape[0], 0


def eligible(head: tuple[int, int, int, int, int, int, int], dtype: np.dtype) -> bool:
    """Whether the kernel applies this part: gap-byte positions and packed differences of 2 or 4-byte
    words (what RL learning rates produce), on a little-endian machine (the digest mixes the words
    as the CPU holds them)."""
    kind, pos_codec, val_codec, _, _, m, n_pos = head
    return (kind == st.DELTA and pos_codec == st.PosCodec.GAP8 and val_codec == st.ValCodec.SUB_PACKED
            and n_pos == 2 and m > 0 and dtype.itemsize in (2, 4) and sys.byteorder == "little")


class Batch:
    """Parts to apply with one kernel call: their decompressed streams back to back in one buffer.

    `add` each part (its target: the whole tensor's words, all of one word dtype; its five streams),
    then `apply`; on an error or a digest mismatch, `undo` puts back every word written. The kernel
    finds each target by address and size (a numba typed list of arrays costs ~12 us an element to
    build); the batch holds the arrays, so the addresses stay valid while it lives. A part added with
    `record` also gets each change's position and new word written, in the same pass, into the two
    arrays `add` returns.
    """

    def __init__(self) -> None:
        self._targets: list[np.ndarray] = []
        self._index: dict[int, int] = {}
        self._rows: list[list[int]] = []
        self._streams: list[Any] = []
        self._at = 0
        self._written: np.ndarray | None = None
        self._args: tuple[Any, ...] = ()
        self._records: list[tuple[np.ndarray, np.ndarray]] = []

    def add(self, target: np.ndarray, start: int, stop: int, m: int, streams: Sequence[Any], sizes: Sequence[int],
            record: bool = False) -> tuple[np.ndarray, np.ndarray] | None:
        """A part covering [start, stop) of `target` with `m` changes: its five decompressed streams
        (anything with the buffer protocol) and their sizes in bytes. With `record`: the arrays (filled
        by `apply`) of its changes' flat positions in `target` (int64, increasing) and new words."""
        if len(streams) != 5 or len(sizes) != 5:
            raise ValueError(f"a delta part of gap bytes and packed values has 5 streams, not {len(streams)}")
        if not target.flags.c_contiguous or not target.flags.writeable or target.ndim != 1:
            raise ValueError("the kernel writes flat, contiguous, writeable word arrays only")
        t = self._index.setdefault(id(target), len(self._targets))
        if t == len(self._targets):
            self._targets.append(target)
        row = [t, start, stop, m]
        for size in sizes:
            row += [self._at, size]
            self._at += size
        out = (np.empty(m, dtype=np.int64), np.empty(m, dtype=target.dtype)) if record else None
        row += [out[0].ctypes.data, out[1].ctypes.data] if out is not None and m else [0, 0]
        if out is not None:
            self._records.append(out)  # held: the kernel writes to their addresses
        self._streams.extend(streams)
        self._rows.append(row)
        return out

    def seal(self) -> None:
        """Build the kernel's arguments: one join of every stream (call once every part is added;
        `apply` does if needed)."""
        buf = np.frombuffer(b"".join(self._streams), dtype=np.uint8)
        if buf.size != self._at:
            raise ValueError(f"streams hold {buf.size} bytes, their sizes say {self._at}")
        self._streams = []
        targets = np.array([(t.ctypes.data, t.size) for t in self._targets], dtype=np.int64).reshape(-1, 2)
        meta = np.array(self._rows, dtype=np.int64).reshape(-1, 16)
        like = self._targets[0][:0] if self._targets else np.zeros(0, dtype=np.uint16)
        self._args = (like, targets, buf, meta, PREFETCH_BYTES // like.itemsize)

    def apply(self) -> tuple[list[str], int, str | None]:
        """Write every part; returns the digests of the parts written in full, and on an error the
        index of the part at fault and the error (then `undo`)."""
        if not self._args:
            self.seal()
        like, targets, buf, meta, ahead = self._args
        if any(t.dtype != like.dtype for t in self._targets):
            raise ValueError("a batch holds targets of one word dtype")
        limits = meta[:, 3].copy()
        digests = np.zeros(len(self._rows), dtype=np.uint64)
        code, at, written = _walk_parts(like, targets, buf, meta, limits, 1, ahead, digests)
        self._written = limits.copy()
        self._written[at:] = 0
        if at < len(self._written):
            self._written[at] = written
        done = [f"{int(h):016x}" for h in digests[: min(at, len(self._rows))]]
        return done, at, ERRORS.get(code, f"kernel error {code}") if code != OK else None

    def undo(self) -> None:
        """Take back every word `apply` wrote (exactly: wrapping subtraction inverts the addition)."""
        if self._written is None or not self._written.any() or not self._args:
            return
        like, targets, buf, meta, ahead = self._args
        _walk_parts(like, targets, buf, meta, self._written, -1, ahead, np.zeros(len(self._rows), dtype=np.uint64))
        self._written[:] = 0


WORDS = (np.dtype(np.uint16), np.dtype(np.uint32))
"""The word dtypes the kernel applies (`eligible`): bf16/fp16 and fp32 tensors."""


def warm_up(words: Sequence[np.dtype] = WORDS) -> None:
    """Compile (or load from numba's disk cache) the kernel and the digest for each word dtype, with
    arguments of exactly the types `Batch` and `digest` pass, on empty inputs: nothing is written.
    Safe from any thread (numba holds a lock while it compiles; a concurrent caller waits for it)."""
    for word in words:
        like = np.zeros(1, dtype=word)[:0]
        meta = np.array([], dtype=np.int64).reshape(-1, 16)
        args = (like, np.array([], dtype=np.int64).reshape(-1, 2), np.frombuffer(b"", dtype=np.uint8), meta)
        for sign in (1, -1):  # apply and undo
            _walk_parts(*args, meta[:, 3].copy(), sign, PREFETCH_BYTES // like.itemsize, np.zeros(0, dtype=np.uint64))
        digest(np.zeros(1, dtype=word))
