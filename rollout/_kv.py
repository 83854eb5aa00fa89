"""Batch surgery on a transformers `DynamicCache` for continuous batching.

The torch engine keeps every running sample in one left-padded batch: row b of each layer's key
and value tensors `[B, heads, L, head_dim]` holds sample b's cache right-aligned, and a 2-D
attention mask `[B, L]` marks the real columns. Admitting samples concatenates a freshly
prefilled batch (left-padded to the same length); finishing samples drops rows and then the
leading columns no row uses any more, so the cache stays as short as its longest sample.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from transformers import DynamicCache


def new_cache() -> DynamicCache:
    # No config: plain full-attention layers, created lazily on the first forward pass.
    return DynamicCache()


def _layers(cache: DynamicCache) -> list[tuple[torch.Tensor, torch.Tensor]]:
    layers: list[Any] = list(cache.layers)  # DynamicLayer: the cache is built without a config
    return [(layer.keys, layer.values) for layer in layers]


def _set(cache: DynamicCache, kv: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    layers: list[Any] = list(cache.layers)
    for layer, (k, v) in zip(layers, kv, strict=True):
        layer.keys, layer.values = k, v


def _left_pad(t: torch.Tensor, length: int) -> torch.Tensor:
    """Pad the sequence dimension (-2 for K/V, -1 for masks) on the left to `length`."""
    extra = length - t.shape[-2 if t.dim() == 4 else -1]
    if extra <= 0:
        return t
    return F.pad(t, (0, 0, extra, 0)) if t.dim() == 4 else F.pad(t, (extra, 0))


def concat(
    a: DynamicCache, mask_a: torch.Tensor, b: DynamicCache, mask_b: torch.Tensor
) -> tuple[DynamicCache, torch.Tensor]:
    """Rows of `a` then rows of `b`, left-padded to a common length; returns (cache, mask)."""
    length = max(mask_a.shape[1], mask_b.shape[1])
    merged = [
        (torch.cat([_left_pad(ka, length), _left_pad(kb, length)]),
         torch.cat([_left_pad(va, length), _left_pad(vb, length)]))
        for (ka, va), (kb, vb) in zip(_layers(a), _layers(b), strict=True)
    ]
    _set(a, merged)
    return a, torch.cat([_left_pad(mask_a, length), _left_pad(mask_b, length)])


def select(cache: DynamicCache, mask: torch.Tensor, rows: torch.Tensor) -> tuple[DynamicCache, torch.Tensor]:
    """Keep `rows`, then drop leading columns that no kept row attends to."""
    mask = mask[rows]
    used = mask.any(dim=0).nonzero()
    start = int(used[0]) if len(used) else mask.shape[1]
    _set(cache, [(k[rows, :, start:], v[rows, :, start:]) for k, v in _layers(cache)])
    return cache, mask[:, start:]
