"""Snapshots of the weights the trainer publishes: cast into buffers that are used again, while the
next step's forward and backward run.

A fresh bf16 copy of a model costs mostly page faults: the allocator maps large tensors anew and
gives them back on free, so every new copy faults in every page again (1.1 s per billion
parameters on the development machine, against 0.23 s to cast into memory already mapped). So the
snapshot is cast into one of `depth` buffer sets in turn.

Two sets suffice for the trainer (the default; each set is 2 bytes per parameter in bf16): a
snapshot is the version being published, then the parent of its successor's publish, and is free
again once that successor has landed. `WeightPublisher.submit` waits for the version in flight to
land before the next snapshot is begun, so the set a new snapshot is cast into is never one the hub
still reads.

The cast runs in the ring's own thread (`begin`), off the step's path: the masters only change at
the next optimizer step, so the snapshot may be taken while the next step's forward and backward
read them. Whatever writes the masters (the optimizer step, loading a checkpoint) calls `fence()`
first, which waits for a cast still running.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_futures

import torch


class SnapshotRing:
    """Casts state dicts into `depth` rotating buffer sets: a snapshot stays valid until `depth - 1`
    more have been taken. One cast at a time."""

    def __init__(self, depth: int = 2) -> None:
        if depth < 1:
            raise ValueError(f"a snapshot ring needs at least one buffer set, not {depth}")
        self.depth = depth
        self._sets: list[dict[str, torch.Tensor]] = []
        self._next = 0
        self._pool: ThreadPoolExecutor | None = None
        self._pending: Future[dict[str, torch.Tensor]] | None = None
        self._lock = threading.Lock()

    def begin(self, state: Mapping[str, torch.Tensor], dtype: torch.dtype) -> Future[dict[str, torch.Tensor]]:
        """Start casting `state` in the ring's thread; returns the snapshot's future. The tensors of
        `state` must not change until it is done: writers call `fence()` first."""
        self.fence()
        with self._lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(1, thread_name_prefix="snapshot")
            self._pending = self._pool.submit(self.take, state, dtype)
            return self._pending

    def fence(self) -> float:
        """Wait for a cast still running (its error, if any, is the publisher's to report); returns
        the seconds waited."""
        pending = self._pending
        if pending is None or pending.done():
            return 0.0
        t0 = time.monotonic()
        wait_futures([pending])
        return time.monotonic() - t0

    def close(self) -> None:
        self.fence()
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None

    @property
    def nbytes(self) -> int:
        """Bytes held by the buffer sets."""
        return sum(t.numel() * t.element_size() for s in self._sets for t in s.values())

    def take(self, state: Mapping[str, torch.Tensor], dtype: torch.dtype) -> dict[str, torch.Tensor]:
        """A copy of `state` in `dtype`, on each tensor's device, in the next buffer set (now, in the
        caller's thread)."""
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
