"""Snapshots of the weights the trainer publishes, cast into buffers that are used again.

A fresh bf16 copy of a model costs mostly page faults: the allocator maps large tensors anew and
gives them back on free, so every new copy faults in every page again (1.1 s per billion
parameters on the development machine, against 0.23 s to cast into memory already mapped). The
snapshot is what a step still waits for when publishing runs in the background, so it is cast into
one of `depth` buffer sets in turn.

Three sets suffice for the trainer: a snapshot is the version being published, then that
version's successor's parent while the successor is in flight (one publish at a time), and is free
again once the successor has landed, which `WeightPublisher.submit` waits for before the next
snapshot is handed over.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch


class SnapshotRing:
    """Casts state dicts into `depth` rotating buffer sets: a snapshot stays valid until `depth - 1`
    more have been taken."""

    def __init__(self, depth: int = 3) -> None:
        if depth < 1:
            raise ValueError(f"a snapshot ring needs at least one buffer set, not {depth}")
        self.depth = depth
        self._sets: list[dict[str, torch.Tensor]] = []
        self._next = 0

    def take(self, state: Mapping[str, torch.Tensor], dtype: torch.dtype) -> dict[str, torch.Tensor]:
        """A copy of `state` in `dtype`, on each tensor's device, in the next buffer set."""
        if len(self._sets) < self.depth:
            self._sets.append({})
            buffers = self._sets[-1]
        else:
            buffers = self._sets[self._next]
            self._next = (self._next + 1) % self.depth
        out: dict[str, torch.Tensor] = {}
        for name, t in state.items():
            buf = buffers.get(name)
            if buf is None or buf.shape != t.shape or buf.dtype != dtype or buf.device != t.device:
                buf = buffers[name] = torch.empty(t.shape, dtype=dtype, device=t.device)
            buf.copy_(t.detach())
            out[name] = buf
        for name in set(buffers) - set(state):  # a tensor the model no longer has
            del buffers[name]
        return out
