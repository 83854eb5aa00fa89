"""A version's changed elements onto the engine's device in one copy (DESIGN.md §5, issue 50).

The torch engine takes a delta as each tensor's changed positions and new values (`TensorChanges`) and
scatters them into its weights between two decoding steps. Sent tensor by tensor, that is two small
host-to-device copies per tensor (~170 for a 0.5 B Qwen2), each from pageable memory, which CUDA stages
through a bounce buffer of its own, and 8-byte positions where 4 do. Here every tensor's positions (as
int32 where the tensor has under 2**31 elements) and values are packed into one host buffer, pinned on
CUDA, that crosses in one asynchronous copy; the scatters then read views of its device copy.

The pinned buffer is kept from one version to the next (pinning is a slow system call) and grows when a
version needs more; before it is filled again the previous copy out of it must have finished (an
event). On the CPU nothing is pinned and the device copy is the buffer itself; the scatter is the same
`index_copy_` of the same values at the same positions, so the weights are bit for bit what the
tensor-by-tensor path wrote.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

_ALIGN = 16
"""Byte alignment of each section: a uint8 view's offset must be a multiple of the viewed dtype's size."""
_INT32_MAX_ELEMENTS = 2**31 - 1
"""Tensors with more elements keep int64 positions."""


def _aligned(n: int) -> int:
    return -(-n // _ALIGN) * _ALIGN


def position_dtype(numel: int) -> torch.dtype:
    """The narrowest index dtype that addresses every element of a tensor of `numel` elements."""
    return torch.int32 if numel <= _INT32_MAX_ELEMENTS else torch.int64


class ChangeUploader:
    """Owns the engine's upload buffer (one per engine; used by the thread that applies versions)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._host: torch.Tensor | None = None
        self._copied: Any = None
        """The CUDA event recorded after the last copy out of `_host` (None: none in flight)."""

    def scatter(self, targets: Sequence[tuple[torch.Tensor, np.ndarray, torch.Tensor]]) -> None:
        """Write each `(flat parameter, sorted positions, values)` into its parameter on the device. The
        caller has checked that the positions fit the parameter and match the values in number."""
        layout, total = [], 0
        for flat, pos, values in targets:
            p_dtype = position_dtype(flat.numel())
            p_at = total
            v_at = p_at + _aligned(len(pos) * p_dtype.itemsize)
            total = v_at + _aligned(values.numel() * values.element_size())
            layout.append((p_dtype, p_at, v_at))
        if not targets:
            return
        host = self._buffer(total)
        for (_, pos, values), (p_dtype, p_at, v_at) in zip(targets, layout, strict=True):
            host[p_at:p_at + len(pos) * p_dtype.itemsize].view(p_dtype).copy_(torch.from_numpy(pos))
            host[v_at:v_at + values.numel() * values.element_size()].view(values.dtype).copy_(values.reshape(-1))
        device_buf = host[:total].to(self.device, non_blocking=True)
        if self.device.type == "cuda":
            self._copied = torch.cuda.Event()
            self._copied.record()
        for (flat, pos, values), (p_dtype, p_at, v_at) in zip(targets, layout, strict=True):
            index = device_buf[p_at:p_at + len(pos) * p_dtype.itemsize].view(p_dtype)
            new = device_buf[v_at:v_at + values.numel() * values.element_size()].view(values.dtype)
            # index_copy_ takes int64 indices: the widening runs on the device, after the 4-byte copy.
            flat.index_copy_(0, index.long(), new.to(flat.dtype))

    def _buffer(self, nbytes: int) -> torch.Tensor:
        """The host buffer, at least `nbytes` long, free to be written (no copy out of it in flight)."""
        if self._copied is not None:
            self._copied.synchronize()
            self._copied = None
        if self._host is None or self._host.numel() < nbytes:
            pin = self.device.type == "cuda"
            size = max(nbytes, 2 * self._host.numel()) if self._host is not None else nbytes
            self._host = torch.empty(size, dtype=torch.uint8, pin_memory=pin)
        return self._host
