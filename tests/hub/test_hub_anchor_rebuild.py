"""Anchors in regions: rebuilt from the region's own chain, so only deltas cross between stores.

Every actor has its own store clients, so its counters are exactly the GETs it sent to each store.
"""

from __future__ import annotations

import pathlib

import pytest
import torch
from hub_helpers import make_config, same_bits, step, tiny_state

from fleetrl.config import FleetConfig
from fleetrl.hub import Hub, Replicator, open_store
from fleetrl.hub import manifest as mf
from fleetrl.hub.stores import ObjectStore

pytestmark = pytest.mark.integration
VERSIONS = 5  # anchors at 0 and 3 (anchor_interval 3)


def three_regions(kind: str, run: str, tmp_path: pathlib.Path, request: pytest.FixtureRequest) -> FleetConfig:
    if kind == "s3":
        bucket, endpoint = request.getfixturevalue("s3_bucket"), request.getfixturevalue("s3_endpoint")
        urls = {n: f"s3://{bucket}/{n}" for n in ("home", "near", "far")}
    else:
        urls, endpoint = {n: (tmp_path / n).as_uri() for n in ("home", "near", "far")}, None
    costs = {"near": {"home": 1, "far": 5}, "far": {"home": 10, "near": 1}}  # far copies from near
    return make_config(run, urls, s3_endpoint=endpoint, link_costs=costs, anchor_interval=3)


def clients(config: FleetConfig) -> dict[str, ObjectStore]:
    return {n: open_store(n, c) for n, c in config.stores().items()}


States = list[dict[str, torch.Tensor]]


def follow(config: FleetConfig, replicators: list[Replicator]) -> tuple[States, list[mf.Manifest]]:
    """Publish the versions one by one; after each, every replicator copies it (the regions follow)."""
    with Hub.from_config(config) as trainer:
        states = [tiny_state()]
        for v in range(VERSIONS):
            if v:
                states.append(step(states[-1], v))
            trainer.publish(states[-1])
            for replicator in replicators:
                assert replicator.replicate_once() == [v]
        return states, [trainer.manifest(v) for v in range(VERSIONS)]


def sizes(objects: set[str], manifests: list[mf.Manifest]) -> int:
    every = {o: s for m in manifests for o, s in m.objects.items()}
    return sum(every[o] for o in objects)


@pytest.mark.parametrize("kind", ["dir", "s3"])
def test_a_region_that_follows_the_chain_reads_no_dense_anchor_across_stores(
        kind: str, run_id: str, tmp_path: pathlib.Path, request: pytest.FixtureRequest) -> None:
    config = three_regions(kind, run_id, tmp_path, request)
    near_view, far_view = clients(config), clients(config)
    near, far = Replicator(config, "near", stores=near_view), Replicator(config, "far", stores=far_view)
    try:
        states, manifests = follow(config, [near, far])
        anchor = manifests[3]
        assert anchor.is_anchor and anchor.parent == 2
        dense = set(anchor.objects) - anchor.delta_objects()
        crossing = {o for m in manifests for o in m.objects} - dense
        # Exactly the deltas (and version 0, which has no parent) cross; the anchor's dense objects never.
        assert near_view["home"].stats.object_gets == len(crossing)
        assert near_view["home"].stats.object_bytes == sizes(crossing, manifests)
        assert far_view["near"].stats.object_gets == len(crossing)
        assert far_view["near"].stats.object_bytes == sizes(crossing, manifests)
        assert far_view["home"].stats.object_gets == 0 and near_view["far"].stats.object_gets == 0
        assert near.rebuilt_bytes == far.rebuilt_bytes == sizes(dense, manifests) > 0
    finally:
        near.close()
        far.close()

    home = open_store("home", config.stores()["home"])
    for region in ("near", "far"):
        store = open_store(region, config.stores()[region])
        for obj in dense:  # byte for byte the published objects: peers cannot tell them apart
            assert store.get(mf.object_key(run_id, obj)) == home.get(mf.object_key(run_id, obj))
        view = clients(config)
        with Hub(config, store=region, stores=view) as node:
            assert same_bits(node.materialize(3), states[3])  # from the rebuilt anchor
            assert same_bits(node.materialize(4), states[4])
            assert node.holders(3) == [region]
        assert all(view[n].stats.object_gets == 0 for n in view if n != region)
    with Hub.from_config(config) as trainer:
        assert trainer.holders(3) == ["far", "home", "near"]


def test_an_anchor_that_does_not_rebuild_identically_is_copied_instead(run_id: str, tmp_path: pathlib.Path) -> None:
    urls = {n: (tmp_path / n).as_uri() for n in ("home", "near")}
    config = make_config(run_id, urls, link_costs={"near": {"home": 1}}, anchor_interval=3)
    # A replicator whose encoder differs from the publisher's (here: another zstd level; in the field:
    # another zstd build) produces other bytes for the dense parts: their sha256 does not match.
    other = config.model_copy(deep=True)
    other.hub.zstd_level = config.hub.zstd_level + 2
    view = clients(other)
    near = Replicator(other, "near", stores=view)
    try:
        states, manifests = follow(config, [near])
    finally:
        near.close()
    everything = {o for m in manifests for o in m.objects}
    assert near.rebuilt_bytes == 0
    assert view["home"].stats.object_gets == len(everything)
    assert view["home"].stats.object_bytes == sizes(everything, manifests)
    with Hub(config, store="near") as node:
        assert same_bits(node.materialize(3), states[3])
