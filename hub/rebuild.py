"""Rebuilding an anchor's dense objects inside a region, so that only deltas cross the WAN.

An anchor N stores every tensor dense and also carries the sparse delta from N-1 in objects of its
own. A region replicator whose store holds N-1 (it has followed the chain) copies only N's manifest
and delta objects across the WAN, materializes N from its own store (N-1 from its verified chain,
then N's delta, every word checked), encodes N's dense parts again with the publisher's codec and
`hub.zstd_level`, and lays them out at the offsets the signed manifest gives. An object is kept only
when its sha256 and size are the ones the manifest names, i.e. when it is byte for byte the object
the trainer published; peers and nodes cannot tell a rebuilt object from a copied one, so the holder
marker keeps its meaning. An object that comes out different (another zstd build or level on either
side) is reported, and the replicator copies it across the WAN instead.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator, Mapping
from concurrent.futures import Executor

import numpy as np

from fleetrl.hub import manifest as mf
from fleetrl.hub.parts import encode_dense_part


def follows_chain(manifest: mf.Manifest) -> bool:
    """Whether anchor `manifest` can be rebuilt from its parent: it has one, and every dense tensor
    also has its delta from it (a publisher without the parent's bits publishes anchors without)."""
    return (manifest.is_anchor and manifest.parent is not None and manifest.parent == manifest.version - 1
            and all(t.delta is not None for t in manifest.tensors if t.encoding == "anchor"))


def dense_objects(manifest: mf.Manifest, words: Mapping[str, np.ndarray], wanted: set[str], level: int,
                  pool: Executor) -> Iterator[tuple[str, bytes | None]]:
    """Each object of `wanted` rebuilt from `words` (the version's tensors as unsigned words), one at
    a time: (object, its bytes) when they match the manifest, (object, None) when they do not."""
    by_object: dict[str, list[tuple[str, mf.PartRef]]] = {obj: [] for obj in wanted}
    for t in manifest.tensors:
        if t.encoding == "anchor":
            for r in t.parts:
                if r.object in by_object:
                    by_object[r.object].append((t.name, r))
    for obj in sorted(wanted):
        parts = sorted(by_object[obj], key=lambda item: item[1].offset)
        yield obj, _assemble(manifest, obj, parts, words, level, pool)


def _assemble(manifest: mf.Manifest, obj: str, parts: list[tuple[str, mf.PartRef]],
              words: Mapping[str, np.ndarray], level: int, pool: Executor) -> bytes | None:
    """One object from its parts laid end to end, or None when anything differs from the manifest."""
    offset = 0
    for name, r in parts:
        if r.offset != offset or name not in words or r.stop > words[name].size:
            return None  # not laid out end to end from 0, or a tensor we do not have
        offset += r.length
    if not parts or offset != manifest.objects.get(obj):
        return None

    def encode(item: tuple[str, mf.PartRef]) -> bytes:
        name, r = item
        return encode_dense_part(words[name][r.start : r.stop], level)

    payloads = list(pool.map(encode, parts))
    if any(len(p) != r.length for p, (_, r) in zip(payloads, parts, strict=True)):
        return None
    data = b"".join(payloads)
    return data if hashlib.sha256(data).hexdigest() == obj else None
