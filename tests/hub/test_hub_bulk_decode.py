"""The bulk decoder of a delta step (all common parts at once) agrees with the per-part decoder."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch
from hub_helpers import same_bits

from fleetrl.config import FleetConfig
from fleetrl.hub import Hub, bulk
from fleetrl.hub import manifest as mf
from fleetrl.hub.parts import decode_part, split_part


def mixed_step(seed: int) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """Tensors of several 64 KiB parts each, changed in the ways RL steps change them: +-1 ulp
    (1-bit indices), a few ulps (2 and 4-bit indices, escapes), very sparse (Rice), dense (bitmap)."""
    g = np.random.default_rng(seed)
    old = {f"t{i}": (g.standard_normal(120_000) * 0.02).astype(np.float32) for i in range(5)}
    state = {k: torch.from_numpy(v).to(torch.bfloat16) for k, v in old.items()}
    new = {}
    for i, (name, t) in enumerate(state.items()):
        bits = t.view(torch.int16).reshape(-1).numpy().copy()
        frac, top = [(0.03, 1), (0.05, 3), (0.05, 20), (0.0004, 1), (0.3, 1)][i]
        idx = np.flatnonzero(g.random(bits.size) < frac)
        steps = np.minimum(g.geometric(0.4, idx.size), top) * np.where(g.random(idx.size) < 0.5, 1, -1)
        steps[g.random(idx.size) < 0.003] = 777  # rare large moves: escapes
        bits[idx] = (bits[idx].astype(np.int64) + steps).astype(np.int16)
        new[name] = torch.from_numpy(bits).view(torch.bfloat16)
    return state, new


def test_bulk_and_per_part_decoders_agree_and_in_place_is_exact(dir_config: Callable[..., FleetConfig]) -> None:
    old, new = mixed_step(3)
    with Hub.from_config(dir_config()) as hub:
        hub.publish(old)
        hub.publish(new)
        manifest = hub.manifest(1)
        items, others = [], 0
        for t in manifest.tensors:
            for r in t.parts:
                data = hub.store.get(mf.object_key(hub.run, r.object), r.offset, r.offset + r.length)
                head, frames = split_part(data)
                if bulk.eligible(head, frames, np.dtype("u2"), r):
                    items.append((bulk.Item(t.name, r, head, frames), data))
                else:
                    others += 1
        assert len(items) > 8 and others > 2  # both paths are exercised
        decoded = bulk.decode([it for it, _ in items], threads=2)
        for i, (it, data) in enumerate(items):
            d = decode_part(data, np.dtype("u2"), it.ref.stop - it.ref.start)
            lo, hi = decoded.offsets[i], decoded.offsets[i + 1]
            assert d.pos is not None
            assert np.array_equal(decoded.pos[lo:hi], d.pos + it.ref.start)
            assert np.array_equal(decoded.diffs[lo:hi], d.words)
        into = {k: v.clone() for k, v in old.items()}
        assert same_bits(hub.materialize(1, into=into, have_version=0), new)
