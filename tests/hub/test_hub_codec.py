"""Property tests of the delta codec: decode(encode(a, b)) == b bit for bit, in every dtype."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fleetrl.hub import parts, streams
from fleetrl.hub.errors import CodecError
from fleetrl.hub.streams import PosCodec, encode_positions
from fleetrl.hub.tensors import DTYPES, from_words, to_words

# Bit patterns that float arithmetic would mangle: NaN payloads (quiet and signalling, both signs),
# +-0, the smallest and largest subnormals, infinities.
SPECIAL = {
    "bfloat16": [0x7FC1, 0xFFC1, 0x7F81, 0xFF81, 0x0000, 0x8000, 0x0001, 0x807F, 0x7F80, 0xFF80],
    "float16": [0x7E01, 0xFE01, 0x7C01, 0x0000, 0x8000, 0x0001, 0x83FF, 0x7C00, 0xFC00],
    "float32": [0x7FC00001, 0xFFC00001, 0x7F800001, 0x00000000, 0x80000000, 0x00000001, 0x807FFFFF,
                0x7F800000],
    "float64": [0x7FF8000000000001, 0x7FF0000000000001, 0x8000000000000000, 0x0000000000000001],
}
DTYPE_NAMES = sorted(DTYPES)


@st.composite
def tensor_pairs(draw: st.DrawFn) -> tuple[str, np.ndarray, np.ndarray]:
    name = draw(st.sampled_from(DTYPE_NAMES))
    dtype = np.dtype(DTYPES[name][1])
    n = draw(st.integers(0, 3000))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    top = 1 if name == "bool" else int(np.iinfo(dtype).max)
    old = rng.integers(0, top, size=n, dtype=dtype, endpoint=True)
    frac = draw(st.sampled_from([0.0, 1e-3, 0.03, 0.2, 0.7, 1.0]))
    mask = rng.random(n) < frac
    new = old.copy()
    how = draw(st.sampled_from(["random", "ulp", "special"]))
    if how == "random" or name == "bool":
        new[mask] = rng.integers(0, top, size=int(mask.sum()), dtype=dtype, endpoint=True)
    elif how == "ulp":
        new[mask] += np.where(rng.random(int(mask.sum())) < 0.5, 1, -1).astype(dtype)  # wraps: fine
    specials = SPECIAL.get(name, [0, top])
    if n:
        idx = rng.integers(0, n, size=min(n, 20))
        for target in (old, new):
            target[idx] = rng.choice(np.array(specials, dtype=dtype), size=idx.size)
    return name, old, new


@settings(max_examples=200, deadline=None)
@given(tensor_pairs())
def test_delta_round_trip_is_bit_exact(case: tuple[str, np.ndarray, np.ndarray]) -> None:
    _, old, new = case
    encoded = parts.encode_delta_part(old, new, level=3)
    payload = None if encoded is None else encoded[0]
    target = old.copy()
    if payload is None:
        assert np.array_equal(old, new)
    else:
        parts.apply_part(payload, target)
    assert target.tobytes() == new.tobytes()
    dense = np.zeros_like(new)
    parts.apply_part(parts.encode_dense_part(new, level=1), dense)
    assert dense.tobytes() == new.tobytes()


@settings(max_examples=50, deadline=None)
@given(tensor_pairs())
def test_torch_bits_survive_the_word_view(case: tuple[str, np.ndarray, np.ndarray]) -> None:
    name, _, new = case
    tensor = from_words(new.copy(), name, [new.size])
    assert tensor.dtype == getattr(torch, DTYPES[name][0])
    assert to_words(tensor).tobytes() == new.tobytes()


@pytest.mark.parametrize(("frac", "codec"), [(0.0005, PosCodec.RICE), (0.03, PosCodec.GAP8), (0.8, PosCodec.BITMAP)])
def test_position_coding_adapts_to_density(frac: float, codec: PosCodec) -> None:
    rng = np.random.default_rng(1)
    n = 2_000_000  # large enough that the fixed bytes streams.SLOW_PART_BYTES charge a slower codec do not decide
    pos = np.flatnonzero(rng.random(n) < frac)
    chosen, _, frames, _ = encode_positions(pos, n, level=3)
    assert chosen == codec
    # Within 10% of n·H(p) on i.i.d. positions (the order-0 bound), plus frame headers.
    p = pos.size / n
    bound_bits = n * -(p * np.log2(p) + (1 - p) * np.log2(1 - p))
    assert sum(len(f) for f in frames) * 8 < 1.1 * bound_bits + 800


def test_one_ulp_steps_cost_about_one_bit_per_value() -> None:
    rng = np.random.default_rng(2)
    old = (rng.standard_normal(100_000).astype(np.float32) * 0.02).view(np.uint32) >> 16
    old = old.astype(np.uint16)
    new = old.copy()
    idx = np.flatnonzero(rng.random(old.size) < 0.03)
    new[idx] += np.where(rng.random(idx.size) < 0.5, 1, -1).astype(np.uint16)
    encoded = parts.encode_delta_part(old, new, level=3)
    payload = None if encoded is None else encoded[0]
    assert payload is not None
    positions = encode_positions(idx, old.size, 3)[2]
    value_bytes = len(payload) - sum(len(f) for f in positions)
    assert value_bytes * 8 < 1.15 * idx.size + 400


def test_truncated_or_garbled_parts_are_refused_before_writing() -> None:
    old = np.arange(1000, dtype=np.uint16)
    new = old.copy()
    new[::7] ^= 0x55
    encoded = parts.encode_delta_part(old, new, level=3)
    payload = None if encoded is None else encoded[0]
    assert payload is not None
    for bad in (payload[:-5], payload[:10], b"XXXX" + payload[4:], payload + b"\0"):
        target = old.copy()
        with pytest.raises(CodecError):
            parts.apply_part(bad, target)
        assert np.array_equal(target, old)


@pytest.mark.parametrize("bits", [1, 2, 4])
def test_packed_differences_with_escapes_round_trip(bits: int) -> None:
    """Differences of a few ulps (real RL steps at 1e-6 move small weights by several) as 1/2/4-bit
    indices into a table of the most frequent ones, with escapes for the rest, decode exactly."""
    rng = np.random.default_rng(bits)
    top = 20 if bits == 4 else 1 << bits  # more distinct differences than table slots: some escape
    diffs = (np.minimum(rng.geometric(0.3, 20_000), top) * np.where(rng.random(20_000) < 0.5, 1, -1))
    diffs[rng.random(diffs.size) < 0.01] = 12345  # rare large moves
    words = streams._zigzag(diffs.astype(np.int64).astype(np.uint16))
    packed = streams._pack_small(words, bits)
    assert packed is not None and packed[2].size > 0  # there are escapes
    raw = [np.frombuffer(p.tobytes(), dtype=np.uint8) for p in packed]
    assert np.array_equal(streams.unpack_small(raw, np.dtype("u2"), words.size), words)
    as_diffs = streams.unpack_small(raw, np.dtype("u2"), words.size, unzigzag=True)
    assert np.array_equal(as_diffs, diffs.astype(np.int64).astype(np.uint16))
