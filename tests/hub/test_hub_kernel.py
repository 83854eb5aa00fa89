"""The compiled in-place kernel (hub/kernels.py): the same words as the numpy decoder, an exact undo,
the publisher's digest, and refusals of inconsistent streams before (or instead of) a wrong write."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest
import torch
from hub_helpers import same_bits
from hypothesis import given, settings
from hypothesis import strategies as st

from fleetrl.config import FleetConfig
from fleetrl.hub import Hub, kernels, parts, streams
from fleetrl.hub import manifest as mf


def streams_of(payload: bytes) -> tuple[parts.Header, list[bytes]]:
    head, frames = parts.split_part(payload)
    return head, [streams.decompress(frame, raw) for frame, raw in frames]


def apply_one(target: np.ndarray, start: int, stop: int, payload: bytes, record: bool = False
              ) -> tuple[kernels.Batch, list[str], int, str | None]:
    head, data = streams_of(payload)
    batch = kernels.Batch()
    out = batch.add(target, start, stop, head[5], data, [len(d) for d in data], record=record)
    assert (out is not None) == record
    digests, at, error = batch.apply()
    if out is not None:
        batch.recorded = out  # type: ignore[attr-defined]
    return batch, digests, at, error


@st.composite
def sparse_changes(draw: st.DrawFn) -> tuple[np.ndarray, np.ndarray]:
    """Old and new words of 2 or 4 bytes, changed the ways RL steps change them: +-1 ulp, a few ulps,
    rare large moves (escapes), long unchanged runs (gaps past 255)."""
    dtype = np.dtype(draw(st.sampled_from(["u2", "u4"])))
    n = draw(st.integers(1, 20_000))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    old = rng.integers(0, np.iinfo(dtype).max, size=n, dtype=dtype, endpoint=True)
    frac = draw(st.sampled_from([1e-4, 3e-3, 0.03, 0.3]))
    idx = np.flatnonzero(rng.random(n) < frac)
    top = draw(st.sampled_from([1, 3, 20]))
    moves = np.minimum(rng.geometric(0.4, idx.size), top) * np.where(rng.random(idx.size) < 0.5, 1, -1)
    moves[rng.random(idx.size) < 0.01] = 7777  # escapes
    new = old.copy()
    new[idx] = (old[idx].astype(np.int64) + moves).astype(dtype)  # wraps, as bit patterns do
    return old, new


@settings(max_examples=60, deadline=None)
@given(sparse_changes())
def test_kernel_writes_what_the_numpy_decoder_writes_and_undoes_exactly(case: tuple[np.ndarray, np.ndarray]) -> None:
    old, new = case
    encoded = parts.encode_delta_part(old, new, level=3)
    if encoded is None:
        assert np.array_equal(old, new)
        return
    payload, digest = encoded
    head, _ = parts.split_part(payload)
    if not kernels.eligible(head, old.dtype):  # the other codecs: the numpy path's business
        return
    # The part covers [start, stop) of a larger tensor: the kernel must stay inside it.
    target = np.concatenate([np.full(7, 0xAB, old.dtype), old, np.full(5, 0xCD, old.dtype)])
    before = target.copy()
    batch, digests, at, error = apply_one(target, 7, 7 + old.size, payload, record=True)
    assert error is None and at == 1
    assert np.array_equal(target[7:-5], new) and np.array_equal(target[:7], before[:7])
    assert np.array_equal(target[-5:], before[-5:])
    assert digests == [digest]  # the publisher's digest, computed by the same mix
    # Recorded in the same pass: each change's position in the target and its new word, in order.
    positions, words = batch.recorded
    changed = np.flatnonzero(old != new)
    assert positions.dtype == np.int64 and np.array_equal(positions, changed + 7)
    assert words.dtype == old.dtype and np.array_equal(words, new[changed])
    reference = old.copy()
    parts.apply_part(payload, reference)  # the numpy decoder
    assert np.array_equal(reference, new)
    batch.undo()
    assert np.array_equal(target, before)


def test_digest_changes_with_any_word_and_its_place() -> None:
    rng = np.random.default_rng(0)
    words = rng.integers(0, 2**16, size=5000, dtype=np.uint16)
    base = kernels.digest(words)
    assert len(base) == 16 and kernels.digest(words.copy()) == base
    for i in (0, 1, 2499, 4999):
        changed = words.copy()
        changed[i] ^= 1
        assert kernels.digest(changed) != base
    swapped = words.copy()
    swapped[[10, 11]] = swapped[[11, 10]]
    assert words[10] == words[11] or kernels.digest(swapped) != base  # the order counts


def stream_payload(old: np.ndarray, new: np.ndarray) -> tuple[parts.Header, list[bytes]]:
    encoded = parts.encode_delta_part(old, new, level=3)
    assert encoded is not None
    head, data = streams_of(encoded[0])
    assert kernels.eligible(head, old.dtype)
    return head, data


def run(target: np.ndarray, head: parts.Header, data: list[bytes], stop: int | None = None) -> tuple[int, str | None]:
    batch = kernels.Batch()
    batch.add(target, 0, target.size if stop is None else stop, head[5], data, [len(d) for d in data])
    _, at, error = batch.apply()
    if error is not None:
        batch.undo()
    return at, error


@pytest.mark.parametrize(("damage", "message"), [
    (lambda d: [d[0][:-1], *d[1:]], "one gap per change"),
    (lambda d: [d[0], d[1][:-4], *d[2:]], "large gap"),
    (lambda d: [d[0], d[1], b"\x03" + d[2][1:], *d[3:]], "1, 2 or 4-bit"),
    (lambda d: [*d[:3], d[3][: len(d[3]) // 2], d[4]], "too short"),
    (lambda d: [*d[:4], d[4][:-2]], "escaped value"),
    (lambda d: [*d[:4], d[4] + b"\x01\x00"], "stray"),
])
def test_inconsistent_streams_are_refused_and_leave_the_target_as_it_was(
        damage: Callable[[list[bytes]], list[bytes]], message: str) -> None:
    rng = np.random.default_rng(3)
    old = rng.integers(0, 2**16, size=40_000, dtype=np.uint16)
    new = old.copy()
    idx = np.flatnonzero(rng.random(old.size) < 0.03)
    idx = np.concatenate([[5], idx[idx > 2000]])  # a gap of more than 255: a large gap in the side stream
    new[idx] += np.where(rng.random(idx.size) < 0.5, 1, -1).astype(np.uint16)
    new[idx[-3:]] += 9000  # escapes
    head, data = stream_payload(old, new)
    target = old.copy()
    at, error = run(target, head, damage(data))
    assert error is not None and message in error, error
    assert at == 0
    assert np.array_equal(target, old)


def test_positions_past_the_part_are_refused_before_a_word_is_written() -> None:
    rng = np.random.default_rng(4)
    old = rng.integers(0, 2**16, size=10_000, dtype=np.uint16)
    new = old.copy()
    new[[100, 5000, 9999]] += 1
    head, data = stream_payload(old, new)
    target = old.copy()
    _, error = run(target, head, data, stop=9000)  # claims the part ends before its last change
    assert error is not None and "past their part" in error
    assert np.array_equal(target, old)


def test_batch_refuses_views_it_cannot_write_in_place() -> None:
    old = np.arange(100, dtype=np.uint16)
    new = old.copy()
    new[3] += 1
    head, data = stream_payload(old, new)
    with pytest.raises(ValueError, match="contiguous"):
        kernels.Batch().add(old[::2], 0, 50, head[5], data, [len(d) for d in data])


def test_a_step_of_many_tensors_and_word_widths_is_exact_in_place(dir_config: Callable[..., FleetConfig]) -> None:
    """bf16 and fp32 tensors in one step (one kernel batch per word width), several batches, and a
    tiny dense-change tensor that the publisher still codes for the kernel."""
    g = torch.Generator().manual_seed(5)
    old = {f"w{i}": torch.randn(70_000, generator=g).to(torch.bfloat16) for i in range(6)}
    old |= {f"f{i}": torch.randn(30_000, generator=g) for i in range(3)}
    old["norm"] = torch.ones(64, dtype=torch.bfloat16)
    new = {}
    for name, t in old.items():
        bits = t.view(torch.int16 if t.dtype == torch.bfloat16 else torch.int32).clone()
        mask = torch.rand(bits.shape, generator=g) < (0.3 if name == "norm" else 0.03)
        bits[mask] += 1
        new[name] = bits.view(t.dtype)
    with Hub.from_config(dir_config()) as hub:
        hub.publish(old)
        hub.publish(new)
        heads = []
        for t in hub.manifest(1).tensors:
            for r in t.parts:
                data = hub.store.get(mf.object_key(hub.run, r.object), r.offset, r.offset + r.length)
                heads.append(parts.split_part(data)[0])
        assert len(heads) > 8 and all((h[1], h[2]) == (streams.PosCodec.GAP8, streams.ValCodec.SUB_PACKED)
                                      for h in heads)
        into = {k: v.clone() for k, v in old.items()}
        assert same_bits(hub.materialize(1, into=into, have_version=0), new)


def test_warm_up_compiles_every_signature_a_real_update_uses(dir_config: Callable[..., FleetConfig]) -> None:
    """A node warms the kernels while it loads its first version, so its first delta does not pay the
    compile (seconds): after `warm_up`, an in-place update of bf16 and fp32 tensors, a failed one
    (undo) and the publisher's digests add no signature to any compiled function."""
    kernels.warm_up()
    compiled = {f: set(getattr(kernels, f).signatures) for f in ("_walk_parts", "_digest")}
    assert all(compiled.values())
    g = torch.Generator().manual_seed(9)
    old = {"w": torch.randn(50_000, generator=g).to(torch.bfloat16), "f": torch.randn(20_000, generator=g)}
    new = {}
    for name, t in old.items():  # +1 ulp at 3 % of the elements: what the kernel's parts carry
        bits = t.view(torch.int16 if t.dtype == torch.bfloat16 else torch.int32).clone()
        bits[torch.rand(bits.shape, generator=g) < 0.03] += 1
        new[name] = bits.view(t.dtype)
    with Hub.from_config(dir_config()) as hub:
        hub.publish(old)
        hub.publish(new)
        into = {k: v.clone() for k, v in old.items()}
        assert hub.changes(1, into, 0) is not None
        assert same_bits(into, new)
        for t in hub.manifest(1).tensors:  # the undo path: a part whose digest does not match
            r = t.parts[0]
            head, data = streams_of(hub.store.get(mf.object_key(hub.run, r.object), r.offset, r.offset + r.length))
            target = np.zeros(r.stop, dtype=kernels.WORDS[0] if t.dtype == "bfloat16" else kernels.WORDS[1])
            batch = kernels.Batch()
            batch.add(target, r.start, r.stop, head[5], data, [len(d) for d in data])
            batch.apply()
            batch.undo()
            assert not target.any()
    assert {f: set(getattr(kernels, f).signatures) for f in compiled} == compiled
