"""One part: the encoding of a contiguous element range of one tensor, the unit of parallel decode.

A tensor is cut into parts of at most `hub.frame_bytes` raw bytes. Each part is a self-describing
byte string, stored back to back with others in one content-addressed object; the manifest gives
its byte range (one ranged GET) and its sha256 (checked before a single byte is decoded).

    magic "FHP1" | kind u8 (0 dense, 1 delta) | pos codec u8 | value codec u8 | rice k u8 |
    n u32 (elements) | m u32 (changed) | streams u8 | position streams u8 |
    per stream: zstd length u32, raw length u32 | the zstd frames

Words are the tensor's bit patterns viewed as unsigned integers of its item size.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

import numpy as np

from fleetrl.hub import kernels
from fleetrl.hub import streams as st
from fleetrl.hub.errors import CodecError

MAGIC = b"FHP1"
_HEAD = struct.Struct("<4sBBBBIIBB")
_STREAM = struct.Struct("<II")
DENSE, DELTA = st.DENSE, st.DELTA
_VAL_CODECS = frozenset(int(c) for c in st.ValCodec)


def _pack(kind: int, pos: int, val: int, k: int, n: int, m: int, n_pos: int,
          frames: list[bytes], sizes: list[int]) -> bytes:
    head = _HEAD.pack(MAGIC, kind, pos, val, k, n, m, len(frames), n_pos)
    table = b"".join(_STREAM.pack(len(f), s) for f, s in zip(frames, sizes, strict=True))
    return head + table + b"".join(frames)


def encode_dense_part(words: np.ndarray, level: int) -> bytes:
    frames, sizes = st.encode_dense(words, level)
    return _pack(DENSE, 0, 0, 0, words.size, words.size, 0, frames, sizes)


def encode_delta_part(old: np.ndarray, new: np.ndarray, level: int) -> tuple[bytes, str] | None:
    """The sparse change from `old` to `new` (same shape and word dtype) and the digest of its new
    words (`kernels.digest`); None when nothing changed."""
    pos = np.flatnonzero(old != new)
    if pos.size == 0:
        return None
    pcodec, k, pframes, psizes = st.encode_positions(pos, old.size, level)
    vcodec, vframes, vsizes = st.encode_values(old[pos], new[pos], level)
    payload = _pack(DELTA, pcodec, vcodec, k, old.size, pos.size, len(pframes), pframes + vframes, psizes + vsizes)
    return payload, kernels.digest(new[pos])


Header = tuple[int, int, int, int, int, int, int]
"""(kind, position codec, value codec, rice k, n, m, position streams) of a part."""


def split_part(payload: bytes | memoryview) -> tuple[Header, list[tuple[memoryview, int]]]:
    """A part's header and its zstd frames with their raw sizes, checked for layout, not decoded."""
    view = memoryview(payload)
    if len(view) < _HEAD.size:
        raise CodecError(f"part of {len(view)} bytes is shorter than its header")
    magic, kind, pos, val, k, n, m, n_streams, n_pos = _HEAD.unpack_from(view)
    if magic != MAGIC:
        raise CodecError(f"part starts with {bytes(magic)!r}, not {MAGIC!r}")
    offset = _HEAD.size + n_streams * _STREAM.size
    if len(view) < offset:
        raise CodecError("part is shorter than its stream table")
    frames = []
    for i in range(n_streams):
        zlen, raw = _STREAM.unpack_from(view, _HEAD.size + i * _STREAM.size)
        if offset + zlen > len(view):
            raise CodecError(f"stream {i} runs past the end of the part (truncated frame)")
        frames.append((view[offset : offset + zlen], raw))
        offset += zlen
    if offset != len(view):
        raise CodecError(f"{len(view) - offset} stray bytes after the last stream")
    return (kind, pos, val, k, n, m, n_pos), frames


def _unpack(payload: bytes | memoryview) -> tuple[Header, list[np.ndarray]]:
    head, frames = split_part(payload)
    return head, [np.frombuffer(st.decompress(frame, raw), dtype=np.uint8) for frame, raw in frames]


@dataclass(frozen=True)
class Decoded:
    """A decoded part: dense words, or sorted changed positions (relative to the part) and their words
    as `streams.new_values` takes them (for SUB_PACKED: the wrapping differences, not their zigzag)."""

    dense: bool
    n: int
    pos: np.ndarray | None
    codec: int
    words: np.ndarray


def decode_part(payload: bytes | memoryview, dtype: np.dtype, n_expected: int) -> Decoded:
    """Decode and check a part without touching any tensor."""
    (kind, pos_codec, val_codec, k, n, m, n_pos), streams = _unpack(payload)
    if n != n_expected:
        raise CodecError(f"part covers {n} elements, its range holds {n_expected}")
    if kind == DENSE:
        words = st.decode_dense(streams, dtype)
        if words.size != n:
            raise CodecError(f"dense part holds {words.size} words, expected {n}")
        return Decoded(True, n, None, 0, words)
    if kind != DELTA:
        raise CodecError(f"unknown part kind {kind}")
    pos = st.decode_positions(pos_codec, k, n, m, streams[:n_pos])
    if val_codec == st.ValCodec.SUB_PACKED:
        words = st.unpack_small(streams[n_pos:], dtype, m, unzigzag=True)
    else:
        words = st.decode_dense(streams[n_pos:], dtype)
    if words.size != m or val_codec not in _VAL_CODECS:
        raise CodecError(f"{words.size} values for {m} positions (value codec {val_codec})")
    return Decoded(False, n, pos, val_codec, words)


def apply_window(d: Decoded, block: np.ndarray, offset: int) -> None:
    """Apply the part's changes that fall in `block`, which holds the part's elements from `offset`."""
    hi = offset + block.size
    if d.dense:
        lo_c, hi_c = max(offset, 0), min(hi, d.n)
        if lo_c < hi_c:
            block[lo_c - offset : hi_c - offset] = d.words[lo_c:hi_c]
        return
    assert d.pos is not None
    i0, i1 = np.searchsorted(d.pos, [offset, hi])
    if i0 == i1:
        return
    where = d.pos[i0:i1] - offset
    block[where] = st.new_values(d.codec, block[where], d.words[i0:i1])


def apply_part(payload: bytes | memoryview, target: np.ndarray) -> int:
    """Apply a part to `target` (the part's element range, unsigned words) in place; returns m.

    Everything is decoded and checked before `target` is written, so a bad part leaves it as it was.
    """
    d = decode_part(payload, target.dtype, target.size)
    apply_window(d, target, 0)
    return d.n if d.dense else int(d.words.size)
