"""Decoding the common parts of one delta step together, in a few large calls.

Decoding part by part costs a few dozen numpy calls per part. A model has ~150 parts of ~20 K
changes each, and there those calls, and handing the GIL between threads around each of them, cost
as much as the arithmetic (on a 2-vCPU VM two threads running 20 K-element numpy calls are slower
than one). So the parts with the codecs of RL learning rates (gap-byte positions, packed differences
of 16-bit words) are decoded together: every zstd frame in one call (C threads, GIL released),
the positions of all parts by one segmented cumsum that yields positions within each tensor, and
the differences by one table lookup. The reader then gathers, adds, checks and scatters once per
tensor. Any other part, or any part set that does not decode here, takes the per-part path.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

import numpy as np
import zstandard

from fleetrl.hub import manifest as mf
from fleetrl.hub import streams as st
from fleetrl.hub.errors import CodecError
from fleetrl.hub.parts import DELTA, Header

_WORD = np.dtype("<u2")


@dataclass(frozen=True)
class Item:
    """One part to decode in bulk: its tensor, reference, header and (frame, raw size) list."""

    name: str
    ref: mf.PartRef
    head: Header
    frames: list[tuple[memoryview, int]]


def eligible(head: Header, frames: list[tuple[memoryview, int]], dtype: np.dtype, ref: mf.PartRef) -> bool:
    kind, pos_codec, val_codec, _, n, m, n_pos = head
    return (kind == DELTA and pos_codec == st.PosCodec.GAP8 and val_codec == st.ValCodec.SUB_PACKED
            and n_pos == 2 and len(frames) == 5 and dtype.itemsize == 2 and m > 0 and n == ref.stop - ref.start)


@dataclass(frozen=True)
class Decoded:
    """Items in order; `pos[offsets[i]:offsets[i+1]]` are item i's changed positions within its tensor
    and `diffs[...]` the wrapping differences to add there."""

    items: list[Item]
    offsets: np.ndarray
    pos: np.ndarray
    diffs: np.ndarray


def decode(items: list[Item], threads: int) -> Decoded:
    """Decode all items; raises CodecError when anything is inconsistent (the caller then decodes
    part by part, which names the part at fault)."""
    segments = _decompress(items, threads)
    m = np.array([it.head[5] for it in items], dtype=np.intp)
    offsets = np.concatenate([[0], np.cumsum(m)])
    pos = _positions(items, segments, m, offsets)
    diffs = _differences(items, segments, m, offsets)
    return Decoded(items, offsets, pos, diffs)


def _decompress(items: list[Item], threads: int) -> list[np.ndarray]:
    frames: list[bytes | bytearray | memoryview] = [frame for it in items for frame, _ in it.frames]
    sizes = [raw for it in items for _, raw in it.frames]
    try:
        out = zstandard.ZstdDecompressor().multi_decompress_to_buffer(
            frames, decompressed_sizes=struct.pack(f"={len(sizes)}Q", *sizes), threads=max(1, threads))
    except zstandard.ZstdError as exc:
        raise CodecError(f"a frame does not decode: {exc}") from exc
    segments = [np.frombuffer(memoryview(out[i]), dtype=np.uint8) if sizes[i] else np.zeros(0, np.uint8)  # type: ignore[arg-type]
                for i in range(len(sizes))]
    if any(seg.size != raw for seg, raw in zip(segments, sizes, strict=True)):
        raise CodecError("a frame holds another number of bytes than its header says")
    return segments


def _positions(items: list[Item], segments: list[np.ndarray], m: np.ndarray, offsets: np.ndarray) -> np.ndarray:
    """Positions within each tensor: one segmented cumsum over the gap bytes of all items, whose
    first step in each segment is set so that the running sum restarts at the part's first element."""
    gaps = np.concatenate([segments[5 * i] for i in range(len(items))])
    bigs = [segments[5 * i + 1].view("<u4") for i in range(len(items))]
    if gaps.size != offsets[-1]:
        raise CodecError("gap streams hold another number of gaps than the headers say")
    steps = np.add(gaps, 1, dtype=np.intp)
    marks = np.flatnonzero(gaps == st.ESCAPE)
    if not np.array_equal(np.diff(np.searchsorted(marks, offsets)), [b.size for b in bigs]):
        raise CodecError("escapes and large gaps do not match")
    if marks.size:
        steps[marks] = np.concatenate(bigs).astype(np.intp) + 1
    starts = np.array([it.ref.start for it in items], dtype=np.intp)
    # Segment i alone would end at starts[i] - 1 + sums[i] (its last position); the running sum enters
    # segment i at the previous segment's end, so its first step makes up the difference.
    ends = starts - 1 + np.add.reduceat(steps, offsets[:-1])
    steps[offsets[:-1]] += starts - 1 - np.concatenate([[0], ends[:-1]])
    np.cumsum(steps, out=steps)
    stops = np.array([it.ref.stop for it in items], dtype=np.intp)
    if np.any(steps[offsets[1:] - 1] >= stops):
        raise CodecError("positions run past their part")
    return steps


def _differences(items: list[Item], segments: list[np.ndarray], m: np.ndarray, offsets: np.ndarray) -> np.ndarray:
    """The wrapping differences of all items: per group of index width, one lookup of whole packed
    bytes in the stacked tables of the items; escapes (zeros) patched from the side streams."""
    diffs = np.empty(int(offsets[-1]), dtype=_WORD)
    by_bits: dict[int, list[int]] = {}
    for i in range(len(items)):
        table = segments[5 * i + 2]
        if table.size < 1 or (table.size - 1) % 2 or table[0] not in (1, 2, 4):
            raise CodecError("packed values need a table of 16-bit words and 1, 2 or 4-bit indices")
        by_bits.setdefault(int(table[0]), []).append(i)
    for bits, members in by_bits.items():
        per_byte = 8 // bits
        blocks: dict[bytes, int] = {}
        tables: list[np.ndarray] = []
        packed: list[np.ndarray] = []
        base: list[tuple[int, int]] = []
        for i in members:
            head, need = segments[5 * i + 2].tobytes(), -(-int(m[i]) // per_byte)
            if (len(head) - 1) // 2 > 1 << bits or segments[5 * i + 3].size < need:
                raise CodecError("packed index stream too short, or table too long")
            if head not in blocks:
                blocks[head] = len(tables)
                tables.append(st.table_rows(head, _WORD))
            packed.append(segments[5 * i + 3][:need])
            base.append((blocks[head] * 256, need))
        index = np.concatenate(packed).astype(np.intp)
        if len(tables) > 1:
            index += np.repeat(np.array([b for b, _ in base], dtype=np.intp), [n for _, n in base])
        values = np.take(np.concatenate(tables), index, axis=0).reshape(-1)
        at = 0
        for i in members:  # drop each item's padding to a whole byte
            diffs[offsets[i] : offsets[i + 1]] = values[at : at + m[i]]
            at += -(-int(m[i]) // per_byte) * per_byte
    rests = [segments[5 * i + 4].view("<u2") for i in range(len(items))]
    zeros = np.flatnonzero(diffs == 0)  # escapes: a difference of a changed word is never 0
    if not np.array_equal(np.diff(np.searchsorted(zeros, offsets)), [r.size for r in rests]):
        raise CodecError("escaped values and their side streams do not match")
    if zeros.size:
        diffs[zeros] = st.unzigzag(np.concatenate(rests).astype(_WORD))
    return diffs


def tensor_groups(items: list[Item], count: int) -> list[list[Item]]:
    """Bulk items split into at most `count` groups of whole tensors with about equal changes
    (largest tensors first, each to the lightest group); manifest order within each group."""
    tensors: dict[str, list[Item]] = {}
    for it in items:
        tensors.setdefault(it.name, []).append(it)
    groups: list[list[Item]] = [[] for _ in range(max(1, count))]
    load = [0] * len(groups)
    for parts in sorted(tensors.values(), key=lambda parts: -sum(it.head[5] for it in parts)):
        g = load.index(min(load))
        groups[g].extend(parts)
        load[g] += sum(it.head[5] for it in parts) + 1024
    return [g for g in groups if g]


def by_tensor(decoded: Decoded) -> list[tuple[str, int, int, list[int]]]:
    """(name, first change, end, item indices) of each tensor of decoded items (consecutive by tensor)."""
    tensors: list[tuple[str, int, int, list[int]]] = []
    for i, it in enumerate(decoded.items):
        a, b = int(decoded.offsets[i]), int(decoded.offsets[i + 1])
        if tensors and tensors[-1][0] == it.name:
            name, first, _, members = tensors[-1]
            tensors[-1] = (name, first, b, [*members, i])
        else:
            tensors.append((it.name, a, b, [i]))
    return tensors
