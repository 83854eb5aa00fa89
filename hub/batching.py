"""How a reader groups parts: into ranged GETs of neighbouring bytes, and into balanced thread batches."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TypeVar

from fleetrl.hub import manifest as mf

T = TypeVar("T")

MERGE_GAP = 1 << 20
"""Neighbouring parts closer than this are fetched in one ranged GET..."""
RANGE_FRAMES = 4
"""...of at most this many frames, so a large object downloads in parallel ranged GETs."""
PART_COST_BYTES = 4096
"""A part's fixed decode cost, in bytes of work."""


def ranged_gets(parts: list[mf.PartRef], limit: int) -> list[tuple[int, int, list[mf.PartRef]]]:
    """Group the parts of one object into ranged GETs of neighbouring parts, each up to `limit` bytes."""
    groups: list[tuple[int, int, list[mf.PartRef]]] = []
    for r in sorted(parts, key=lambda r: r.offset):
        if groups and r.offset - groups[-1][1] <= MERGE_GAP and r.offset + r.length - groups[-1][0] <= limit:
            lo, hi, members = groups[-1]
            groups[-1] = (lo, max(hi, r.offset + r.length), [*members, r])
        else:
            groups.append((r.offset, r.offset + r.length, [r]))
    return groups


def balanced(items: Sequence[T], count: int, size: Callable[[T], int]) -> list[list[T]]:
    """At most `count` batches of about equal work: largest first, each to the lightest batch so far.

    Bytes are the proxy for decode work, plus a fixed cost per part.
    """
    bins: list[list[T]] = [[] for _ in range(max(1, min(count, len(items))))]
    load = [0] * len(bins)
    for item in sorted(items, key=lambda item: -size(item)):
        i = load.index(min(load))
        bins[i].append(item)
        load[i] += size(item) + PART_COST_BYTES
    return [b for b in bins if b]
