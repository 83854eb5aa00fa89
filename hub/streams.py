"""Entropy streams of the delta codec: zstd frames, changed positions and stored values.

A delta part (see `parts.py`) is a handful of byte streams, each its own zstd frame so that zstd's
Huffman stage sees one distribution at a time. Positions of changed elements are gap-coded in one of
three ways, whichever is smallest for the part: gap bytes (gaps < 255 in one byte, larger ones in a
side stream; near the entropy bound for 1/200 < p < 1/2), Rice (k raw low bits plus a small
quotient; for very sparse changes), or a bitmap (dense changes). Values are bit patterns taken as
unsigned integers, stored raw, XOR-ed with the old pattern, or as the zigzag of the wrapping integer
difference of the patterns (at RL learning rates almost every change is ±1 ulp, one bit of entropy).
Everything is integer arithmetic on bit patterns: decode(encode(old, new)) == new bit for bit.
"""

from __future__ import annotations

import functools
import threading
from enum import IntEnum

import numpy as np
import zstandard

from fleetrl.hub.errors import CodecError

_local = threading.local()
ESCAPE = 255
DENSE, DELTA = 0, 1
"""Part kinds (parts.py): a dense range of words, or the sparse change from the previous version."""


class PosCodec(IntEnum):
    GAP8 = 1
    RICE = 2
    BITMAP = 3


class ValCodec(IntEnum):
    RAW = 1
    XOR = 2
    SUB = 3
    SUB_PACKED = 4
    """SUB as 1, 2 or 4-bit indices into a table of the most frequent differences, plus escapes
    (zstd's Huffman stage spends at least a bit per byte: one byte per ±1 ulp wastes half of it)."""


def compress(data: bytes | memoryview | np.ndarray, level: int) -> bytes:
    """One zstd frame (content size written, no checksum: parts carry a sha256 of their own)."""
    cache = getattr(_local, "compressors", None)
    if cache is None:
        cache = _local.compressors = {}
    cctx = cache.get(level)
    if cctx is None:
        # Our streams are near-random symbols whose gain is in zstd's entropy stage; short LZ matches
        # cost more than the literals they replace (measured: 14% over the entropy at min_match 3-4).
        params = zstandard.ZstdCompressionParameters.from_level(
            level, write_checksum=0, write_content_size=1, min_match=7)
        cctx = cache[level] = zstandard.ZstdCompressor(compression_params=params)
    return cctx.compress(data.tobytes() if isinstance(data, np.ndarray) else bytes(data))


def decompress(frame: bytes | memoryview, expected: int) -> bytes:
    """Decode one frame that must hold exactly `expected` bytes."""
    dctx = getattr(_local, "dctx", None)
    if dctx is None:
        dctx = _local.dctx = zstandard.ZstdDecompressor()
    try:
        out = dctx.decompress(frame, max_output_size=max(expected, 1))
    except zstandard.ZstdError as exc:
        raise CodecError(f"zstd frame does not decode: {exc}") from exc
    if len(out) != expected:
        raise CodecError(f"zstd frame holds {len(out)} bytes, expected {expected}")
    return out


# --- positions --------------------------------------------------------------------------------


def _escape_bytes(values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Values < 255 as bytes; larger ones become 255 in the byte stream and go to a uint32 side stream."""
    small = values < ESCAPE
    return np.where(small, values, ESCAPE).astype(np.uint8), values[~small].astype("<u4")


def _unescape(stream: np.ndarray, big: np.ndarray) -> np.ndarray:
    """The escaped values as int64 (used by Rice quotients; gaps have a one-pass decoder below)."""
    out = stream.astype(np.int64)
    marks = np.flatnonzero(stream == ESCAPE)
    if marks.size != big.size:
        raise CodecError(f"{marks.size} escapes but {big.size} large values")
    out[marks] = big
    return out


def _gap_positions(stream: np.ndarray, big: np.ndarray) -> np.ndarray:
    """Positions from gap bytes in as few passes as numpy allows: pos_i = sum_{j<=i} (gap_j + 1) - 1,
    so widen gap+1 in one ufunc call, patch the escapes, take one off the first step (instead of off
    every position) and cumsum in place."""
    steps = np.add(stream, 1, dtype=np.intp)
    marks = np.flatnonzero(stream == ESCAPE)
    if marks.size != big.size:
        raise CodecError(f"{marks.size} escapes but {big.size} large values")
    if marks.size:
        steps[marks] = big.astype(np.intp) + 1
    if steps.size:
        steps[0] -= 1
    np.cumsum(steps, out=steps)
    return steps


def _low_bits(packed: np.ndarray, m: int, k: int) -> np.ndarray:
    """m k-bit little-endian fields of a bit stream as int64: unpack the bits, spread each field over
    a whole 8-, 16- or 32-bit slot, and repack the flat array (packbits on a flat array is one fast
    pass; per-row packing is not)."""
    bits = np.unpackbits(packed, bitorder="little", count=m * k).reshape(m, k)
    width = 8 if k <= 8 else 16 if k <= 16 else 32
    spread = np.zeros((m, width), dtype=np.uint8)
    spread[:, :k] = bits
    words = np.packbits(spread.reshape(-1), bitorder="little").view(f"<u{width // 8}")
    return words.astype(np.int64)


def encode_positions(pos: np.ndarray, n: int, level: int) -> tuple[IntEnum, int, list[bytes], list[int]]:
    """Smallest coding of the sorted changed positions `pos` in [0, n).

    Returns (codec, rice k, zstd streams, raw lengths of the streams).
    """
    m = pos.size
    gaps = np.diff(pos, prepend=-1) - 1
    candidates: list[tuple[IntEnum, int, list[np.ndarray]]] = [(PosCodec.GAP8, 0, list(_escape_bytes(gaps)))]
    if m * 64 < n:
        k = max(1, int(np.log2(n / m)) - 1)
        quotient, big = _escape_bytes(gaps >> k)
        low = np.packbits(((gaps[:, None] >> np.arange(k)) & 1).astype(np.uint8), bitorder="little")
        candidates.append((PosCodec.RICE, k, [low, quotient, big]))
    if m * 6 > n:
        mask = np.zeros(n, dtype=np.uint8)
        mask[pos] = 1
        candidates.append((PosCodec.BITMAP, 0, [np.packbits(mask, bitorder="little")]))
    return _smallest(candidates, level, _POS_COST)


SLOW_PART_BYTES = 128
"""A part the reader's kernel (kernels.py) cannot apply costs it a few dozen microseconds of Python
(measured: ~36 us); the small dense-change parts of norm weights and biases would otherwise pay
that for a saving of a few dozen bytes."""
_POS_COST: dict[IntEnum, tuple[float, int]] = {
    PosCodec.GAP8: (1.0, 0), PosCodec.RICE: (1.02, SLOW_PART_BYTES), PosCodec.BITMAP: (1.02, SLOW_PART_BYTES)}
"""(factor, extra bytes) a coding's size is weighed with when choosing: gap bytes decode fastest (the
kernel walks them); Rice and bitmaps must save more than 2% and SLOW_PART_BYTES to be chosen
(readers decode every part, publishers encode it once)."""
_VAL_COST: dict[IntEnum, tuple[float, int]] = {
    ValCodec.SUB_PACKED: (1.0, 0), ValCodec.RAW: (1.0, SLOW_PART_BYTES), ValCodec.XOR: (1.0, SLOW_PART_BYTES),
    ValCodec.SUB: (1.0, SLOW_PART_BYTES)}
"""The same for values: the kernel applies packed differences only."""


def decode_positions(codec: int, k: int, n: int, m: int, streams: list[np.ndarray]) -> np.ndarray:
    """Inverse of `encode_positions` (intp, increasing); checks the count and that they lie in [0, n)."""
    if codec == PosCodec.GAP8:
        if len(streams) != 2 or streams[0].size != m:
            raise CodecError(f"gap streams hold {streams[0].size if streams else 0} gaps, header says {m}")
        pos = _gap_positions(streams[0], streams[1].view("<u4"))
    elif codec == PosCodec.RICE:
        if len(streams) != 3 or streams[1].size != m or not 0 < k < 32 or streams[0].size * 8 < m * k:
            raise CodecError(f"Rice streams do not hold {m} gaps of {k} low bits")
        gaps = (_unescape(streams[1], streams[2].view("<u4")) << k) | _low_bits(streams[0], m, k)
        pos = np.cumsum(gaps + 1) - 1
    elif codec == PosCodec.BITMAP:
        if len(streams) != 1 or streams[0].size * 8 < n:
            raise CodecError(f"bitmap too short for {n} elements")
        # As bool, nonzero takes numpy's fast path (9x faster than on uint8 zeros and ones).
        pos = np.flatnonzero(np.unpackbits(streams[0], bitorder="little", count=n).view(bool))
        if pos.size != m:
            raise CodecError(f"bitmap marks {pos.size} positions, header says {m}")
        return pos
    else:
        raise CodecError(f"unknown position codec {codec}")
    # Gaps are unsigned, so positions increase strictly; only the last one can run past the part.
    if m and int(pos[-1]) >= n:
        raise CodecError(f"positions run past the part's {n} elements")
    return pos


# --- values -----------------------------------------------------------------------------------


def _planes(words: np.ndarray) -> list[np.ndarray]:
    """Byte planes of little-endian words: the high planes (sign, exponent) compress on their own."""
    width = words.dtype.itemsize
    as_bytes = words.astype(words.dtype.newbyteorder("<"), copy=False).view(np.uint8).reshape(-1, width)
    return [np.ascontiguousarray(as_bytes[:, i]) for i in range(width)]


def _unplanes(planes: list[np.ndarray], dtype: np.dtype) -> np.ndarray:
    if len(planes) != dtype.itemsize or len({p.size for p in planes}) != 1:
        raise CodecError(f"{len(planes)} byte planes of unequal or wrong count for {dtype.itemsize}-byte words")
    stacked = np.stack(planes, axis=1) if planes[0].size else np.zeros((0, len(planes)), np.uint8)
    return np.ascontiguousarray(stacked).view(dtype.newbyteorder("<")).reshape(-1).astype(dtype, copy=False)


def _signed(dtype: np.dtype) -> np.dtype:
    return np.dtype(f"i{dtype.itemsize}")


def _zigzag(diff: np.ndarray) -> np.ndarray:
    signed = diff.view(_signed(diff.dtype))
    shift = 8 * diff.dtype.itemsize - 1
    return ((signed << 1) ^ (signed >> shift)).view(diff.dtype)


def _unzigzag(zz: np.ndarray) -> np.ndarray:
    sign = (zz & 1).view(_signed(zz.dtype))
    return (zz >> 1) ^ (-sign).view(zz.dtype)


def _ranked(values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The distinct values by falling frequency (ties by value), and each value's rank in that order:
    one sort, shared by the 1, 2 and 4-bit packings (`_pack_small`) of the same values."""
    table, inverse, counts = np.unique(values, return_inverse=True, return_counts=True)
    order = np.argsort(-counts, kind="stable")
    rank = np.empty(table.size, dtype=np.int64)
    rank[order] = np.arange(table.size)
    return table[order], rank[inverse.reshape(-1)]


def _pack_small(values: np.ndarray, bits: int, ranked: tuple[np.ndarray, np.ndarray] | None = None
                ) -> list[np.ndarray] | None:
    """The most frequent values as a table, every value as a `bits`-wide index packed 8/bits to a byte
    (zstd's Huffman stage then codes whole bytes, i.e. groups of indices, close to their entropy), and
    the values outside the table, marked by the last index, in a side stream. None when pointless.
    `ranked`: `_ranked(values)`, when the caller packs the same values more than once."""
    by_rank, rank = ranked if ranked is not None else _ranked(values)
    slots = 1 << bits
    if by_rank.size > slots * 4 and bits < 4:
        return None  # too many escapes to be worth trying
    kept = by_rank.size if by_rank.size <= slots else slots - 1
    index = rank.copy()
    escaped = index >= kept
    index[escaped] = slots - 1
    head = np.concatenate([[bits], by_rank[:kept].astype(by_rank.dtype.newbyteorder("<"))
                           .view(np.uint8)]).astype(np.uint8)
    per_byte = 8 // bits
    padded = np.zeros(-(-index.size // per_byte) * per_byte, dtype=np.uint8)
    padded[: index.size] = index
    shifts = (np.arange(per_byte) * bits).astype(np.uint8)
    packed = np.bitwise_or.reduce(padded.reshape(-1, per_byte) << shifts, axis=1).astype(np.uint8)
    rest = values[escaped].astype(values.dtype.newbyteorder("<")).view(np.uint8)
    return [head, packed, np.ascontiguousarray(rest)]


def unpack_small(streams: list[np.ndarray], dtype: np.dtype, m: int, *, unzigzag: bool = False) -> np.ndarray:
    """Inverse of `_pack_small`: `m` values of word dtype `dtype` (with `unzigzag`, the wrapping
    differences they stand for: the table is unzigzagged, not the `m` values). The values are never 0
    (`_pack_small` packs the differences of changed words only), which the escapes rely on.

    A lookup table maps each packed byte straight to its 8/bits values (one `np.take` of whole rows),
    so decoding costs one pass over the output; escaped slots are patched from the side stream.
    """
    if len(streams) != 3 or streams[0].size < 1 or (streams[0].size - 1) % dtype.itemsize:
        raise CodecError("packed values need a table, an index stream and an escape stream")
    bits = int(streams[0][0])
    if bits not in (1, 2, 4):
        raise CodecError(f"packed values with {bits}-bit indices")
    per_byte, slots = 8 // bits, 1 << bits
    table_size = (streams[0].size - 1) // dtype.itemsize
    if streams[1].size * per_byte < m or table_size > slots:
        raise CodecError(f"packed index stream too short for {m} values, or table of {table_size} too long")
    rest = streams[2].view(dtype.newbyteorder("<")).astype(dtype)
    if unzigzag:
        rest = _unzigzag(rest)
    packed = streams[1][: -(-m // per_byte)]
    out = np.take(_rows(streams[0].tobytes(), dtype, unzigzag), packed, axis=0).reshape(-1)[:m]
    if rest.size:
        # Escape indices decode to 0 (the padding of the table), and 0 is never a real value: these
        # are differences (or their zigzag) of changed words. So the zeros are the escapes.
        escaped = np.flatnonzero(out == 0)
        if escaped.size != rest.size:
            raise CodecError(f"{escaped.size} escaped values but {rest.size} stored")
        out[escaped] = rest
    # An escape with an empty escape stream would stay 0: the part's sha256 and the sha256 checked
    # after apply catch that, so no pass over the output is spent looking for it.
    return out


@functools.lru_cache(maxsize=64)
def _rows(head: bytes, dtype: np.dtype, unzigzag: bool) -> np.ndarray:
    """(256, 8/bits) values of each packed byte, for one table (`head`: bits, then the table). At RL
    learning rates nearly every part has the same table (the zigzag of -1 and +1): cache it."""
    bits = head[0]
    table = np.frombuffer(head[1:], dtype=dtype.newbyteorder("<")).astype(dtype)
    full = np.zeros(1 << bits, dtype=dtype)
    full[: table.size] = _unzigzag(table) if unzigzag else table
    rows: np.ndarray = full[_SLOTS[bits]]
    rows.flags.writeable = False
    return rows


_SLOTS = {bits: ((np.arange(256)[:, None] >> (np.arange(8 // bits) * bits)) & ((1 << bits) - 1)).astype(np.uint8)
          for bits in (1, 2, 4)}


def encode_values(old: np.ndarray, new: np.ndarray, level: int) -> tuple[IntEnum, list[bytes], list[int]]:
    """Smallest of raw, XOR and zigzag-difference coding of the changed words (`old`/`new` at positions)."""
    diff = _zigzag(new - old)
    candidates: list[tuple[IntEnum, int, list[np.ndarray]]] = [
        (ValCodec.RAW, 0, _planes(new)),
        (ValCodec.XOR, 0, _planes(old ^ new)),
        (ValCodec.SUB, 0, _planes(diff)),
    ]
    ranked = _ranked(diff)
    for bits in (1, 2, 4):
        packed = _pack_small(diff, bits, ranked)
        if packed is not None:
            candidates.append((ValCodec.SUB_PACKED, bits, packed))
    codec, _, frames, sizes = _smallest(candidates, level, _VAL_COST)
    return codec, frames, sizes


def new_values(codec: int, old: np.ndarray | None, words: np.ndarray) -> np.ndarray:
    """The new words at the changed positions from the old ones (not needed for RAW) and the stored words."""
    if codec == ValCodec.RAW:
        return words
    if old is None:
        raise CodecError(f"value codec {codec} needs the old words")
    if codec == ValCodec.XOR:
        return old ^ words
    if codec == ValCodec.SUB:
        return old + _unzigzag(words)
    if codec == ValCodec.SUB_PACKED:
        return old + words  # `parts.decode_part` hands these out as differences already
    raise CodecError(f"unknown value codec {codec}")


def encode_dense(words: np.ndarray, level: int) -> tuple[list[bytes], list[int]]:
    planes = _planes(words)
    return [compress(p, level) for p in planes], [p.size for p in planes]


def decode_dense(streams: list[np.ndarray], dtype: np.dtype) -> np.ndarray:
    return _unplanes(streams, dtype)


def _smallest(
    candidates: list[tuple[IntEnum, int, list[np.ndarray]]], level: int,
    cost: dict[IntEnum, tuple[float, int]],
) -> tuple[IntEnum, int, list[bytes], list[int]]:
    """Compress every candidate coding and keep the one with the fewest bytes (times its decode
    factor, plus its extra bytes: `cost`)."""
    best: tuple[float, IntEnum, int, list[bytes], list[int]] | None = None
    for codec, k, raw in candidates:
        frames = [compress(r, level) for r in raw]
        factor, extra = cost[codec]
        size = sum(len(f) for f in frames) * factor + extra
        if best is None or size < best[0]:
            best = (size, codec, k, frames, [r.nbytes for r in raw])
    assert best is not None
    return best[1], best[2], best[3], best[4]
