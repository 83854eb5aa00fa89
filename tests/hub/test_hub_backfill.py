"""A region store stays whole: every version from where its chain starts, each one verified, at any moment.

After a partition, a kill or an older replicator's jump, the region's replicator copies the versions
it lacks in order (never jumping to a newer anchor past them), fills holes it finds at its start, and
only when a version is in no store any more (collected by `fleetrl hub gc`) starts the region's chain
again at the oldest version home holds and retires what is below it.

The home store is a real moto S3 server reached through a loopback relay that the test cuts and
heals (`fleetrl.demo.relay`, what `fleetrl demo --partition` uses); the region store is a directory;
the replicator is the real `fleetrl replicator` daemon where the test says so.
"""

from __future__ import annotations

import pathlib
import uuid
from collections.abc import Iterator
from dataclasses import dataclass

import pytest
import torch
import yaml
from hub_helpers import ReplicatorDaemon, same_bits, step, tiny_state, wait_for
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from slowdown import scaled

from fleetrl.config import FleetConfig, load_config
from fleetrl.demo.relay import Relay, RelayHub
from fleetrl.hub import Hub, Replicator, StoreCheck, open_store
from fleetrl.hub import manifest as mf

pytestmark = pytest.mark.integration
ANCHOR_INTERVAL = 4
LEASE_TTL_S = scaled(10.0)
"""The replicator's lease. Only a daemon stalled that long between two renewals loses it, so a catch-up the
tests follow stays one pass (one route logged, holes found once) however slow the machine: a slower machine
stalls longer, so it is scaled by the machine's slowdown."""
SHORT_LEASE_TTL_S = 1.5
"""Where a test kills a daemon that holds the lease and its successor waits out the expiry; their verdicts
hold whether or not a pass is split by a lease lost under load."""


@pytest.fixture
def relays() -> Iterator[RelayHub]:
    hub = RelayHub()
    yield hub
    hub.close()


@dataclass
class Fleet:
    """Home (S3, through a relay the region's replicator uses) and one region store `b` (a directory)."""

    trainer: FleetConfig
    """What the trainer sees: home directly."""
    region_file: pathlib.Path
    """What the region's replicator reads: home through the relay."""
    region: FleetConfig
    relay: Relay
    states: list[dict[str, torch.Tensor]]

    def publish(self, n: int) -> int:
        """n more versions at home; returns the newest."""
        with Hub.from_config(self.trainer) as hub:
            for _ in range(n):
                state = step(self.states[-1], len(self.states)) if self.states else tiny_state()
                self.states.append(state)
                assert hub.publish(state).version == len(self.states) - 1
        return len(self.states) - 1

    def check(self, store: str = "b") -> StoreCheck:
        with Hub(self.region, store=store) as hub:
            return hub.verify_store()

    def latest(self, store: str = "b") -> int | None:
        with Hub(self.region, store=store) as hub:
            return hub.latest()


def make_fleet(tmp_path: pathlib.Path, s3_endpoint: str, bucket: str, relays: RelayHub, **hub: object) -> Fleet:
    run = f"t{uuid.uuid4().hex[:10]}"
    moto_port = int(s3_endpoint.rsplit(":", 1)[1])
    relay = relays.add(Relay(f"b-{run}/home-store", moto_port))

    def doc(endpoint: str) -> dict[str, object]:
        return {
            "run": run,
            "hub": {"home_store": {"url": f"s3://{bucket}/{run}", "endpoint_url": endpoint, "region_name": "us-east-1"},
                    "anchor_interval": ANCHOR_INTERVAL, "threads": 1, "poll_interval_s": 0.1,
                    "lease_ttl_s": LEASE_TTL_S, "frame_bytes": 64 * 1024, **hub},
            "regions": [{"name": "b", "kafka": "127.0.0.1:9", "store": str(tmp_path / run / "b"),
                         "link_costs": {"home": 1}}],
        }

    trainer = FleetConfig.model_validate(doc(s3_endpoint))
    region_file = tmp_path / run / "fleet.yaml"
    region_file.parent.mkdir(parents=True)
    region_file.write_text(yaml.safe_dump(doc(f"http://127.0.0.1:{relay.port}")))
    return Fleet(trainer, region_file, load_config(region_file), relay, [])


def assert_whole(check: StoreCheck, first: int = 0) -> None:
    """Gapless from `first`, every version verified, `latest` one of them."""
    assert check.ok, check
    assert check.versions == list(range(first, check.versions[-1] + 1)), check


def test_a_partition_spanning_many_versions_heals_with_every_version_in_the_region_store(
        tmp_path: pathlib.Path, s3_endpoint: str, s3_bucket: str, relays: RelayHub) -> None:
    """Twelve versions (three anchors) published while the region is cut off from home: after the heal
    the region holds 0..14, each verified, and the daemon logged an in-order catch-up."""
    fleet = make_fleet(tmp_path, s3_endpoint, s3_bucket, relays)
    fleet.publish(3)
    daemon = ReplicatorDaemon(fleet.region_file, "b", tmp_path / "b.log")
    try:
        wait_for(lambda: fleet.latest() == 2, 60, "versions 0..2 in region b")
        relays.cut(fleet.relay.name)
        newest = fleet.publish(12)
        assert_whole(fleet.check())  # while cut: whole, and behind
        assert fleet.latest() == 2
        relays.heal(fleet.relay.name)
        wait_for(lambda: fleet.latest() == newest, 60, f"region b to catch up to {newest}")
        assert_whole(fleet.check())
        assert fleet.check().versions == list(range(newest + 1))
        route = daemon.events("replicator.catch_up")[-1]  # the first was 0..2 into the empty store
        assert (route["versions"], route["route"], route["anchor"]) == ("3-14", "in_order", 12), route
        assert "3-11" in route["reason"] and route["bytes_from_anchor"] > 0, route
        # anchors 4, 8 and 12 were rebuilt from the region's own chain: only deltas crossed
        assert sorted(e["version"] for e in daemon.events("replicator.rebuilt")) == [4, 8, 12]
    finally:
        daemon.stop()
    with Hub(fleet.region, store="b") as node:  # a node of the region builds the newest from its store
        assert same_bits(node.materialize(newest), fleet.states[newest])


def test_holes_an_older_replicator_left_are_found_and_filled_at_start(
        tmp_path: pathlib.Path, s3_endpoint: str, s3_bucket: str, relays: RelayHub) -> None:
    """What an older replicator left after a partition (versions 5..7 missing below a `latest` at 11, so
    that a node of the region could not build 8..11 along the chain): the next daemon fills them first."""
    fleet = make_fleet(tmp_path, s3_endpoint, s3_bucket, relays)
    fleet.publish(1)
    replicator = Replicator(fleet.region, "b")
    assert replicator.replicate_once() == [0]
    fleet.publish(11)
    assert replicator.replicate_once() == list(range(1, 12))
    region = open_store("b", fleet.region.stores()["b"])
    for v in (5, 6, 7):
        region.delete(mf.version_key(fleet.region.run, v))
        region.delete(mf.holder_key(fleet.region.run, v, "b"))
    assert fleet.check().gaps == [5, 6, 7]
    daemon = ReplicatorDaemon(fleet.region_file, "b", tmp_path / "b.log")
    try:
        wait_for(lambda: fleet.check().versions == list(range(12)), 60, "the holes 5..7 to be filled")
        assert_whole(fleet.check())
        assert [e["holes"] for e in daemon.events("replicator.holes_found")] == ["5-7"]
        assert [e["version"] for e in daemon.events("replicator.copied")] == [5, 6, 7]
        assert fleet.latest() == 11  # a hole filled never moves `latest` back
    finally:
        daemon.stop()


def test_a_catch_up_killed_between_versions_goes_on_in_order_after_a_restart(
        tmp_path: pathlib.Path, s3_endpoint: str, s3_bucket: str, relays: RelayHub) -> None:
    """The crash point `hub.replicate.backfilled`: a daemon dies after the first version of a ten-version
    catch-up; its successor copies the rest in order (it used to jump to the newest anchor)."""
    fleet = make_fleet(tmp_path, s3_endpoint, s3_bucket, relays, lease_ttl_s=SHORT_LEASE_TTL_S)
    fleet.publish(2)
    assert Replicator(fleet.region, "b").replicate_once() == [0, 1]
    newest = fleet.publish(10)
    crashed = ReplicatorDaemon(fleet.region_file, "b", tmp_path / "b0.log",
                               env={"FLEETRL_CRASH_AT": "hub.replicate.backfilled@2"})
    assert crashed.proc.wait(timeout=scaled(60)) == -9
    crashed.kill()
    assert fleet.latest() == 3  # 2 and 3 copied, then the kill
    assert_whole(fleet.check())
    daemon = ReplicatorDaemon(fleet.region_file, "b", tmp_path / "b1.log")
    try:
        wait_for(lambda: fleet.latest() == newest, 60, f"the restart to reach {newest}")
        assert_whole(fleet.check())
        assert [e["version"] for e in daemon.events("replicator.copied")] == list(range(4, newest + 1))
    finally:
        daemon.stop()


def test_versions_collected_from_every_store_restart_the_region_chain_at_home_s_oldest(
        tmp_path: pathlib.Path, s3_endpoint: str, s3_bucket: str, relays: RelayHub) -> None:
    """The region was away while home's gc ran (window 4): versions 3.. are in no store. The region's
    chain starts again at home's oldest version (an anchor) and its older versions are retired, so that
    the region store is gapless and whole, and peers no longer look for the retired ones there."""
    fleet = make_fleet(tmp_path, s3_endpoint, s3_bucket, relays, retention_versions=4, gc_grace_s=0)
    fleet.publish(3)
    replicator = Replicator(fleet.region, "b")
    assert replicator.replicate_once() == [0, 1, 2]
    newest = fleet.publish(16)
    with Hub.from_config(fleet.trainer) as home:
        kept = home.gc().kept_versions
        assert kept[0] > 3 and kept[0] % ANCHOR_INTERVAL == 0, kept
    assert replicator.replicate_once() == []  # 3 is gone: the chain restarts at kept[0]
    assert replicator.replicate_once() == list(range(kept[0], newest + 1))
    assert_whole(fleet.check(), first=kept[0])
    region = open_store("b", fleet.region.stores()["b"])
    held = {int(i.key.split("/")[2]) for i in region.scan(f"{fleet.region.run}/holders/")}
    assert held == set(range(kept[0], newest + 1))  # no holder reference of a retired version is left
    with Hub.from_config(fleet.trainer) as home:
        assert "b" in home.holders(newest)


def test_a_node_whose_chain_meets_a_missing_manifest_builds_from_the_anchor(
        tmp_path: pathlib.Path, s3_endpoint: str, s3_bucket: str, relays: RelayHub) -> None:
    """A node at version 2 asks for 6 while 3's manifest is missing from its store (a hole, or a retired
    version): it builds 6 from the anchor at 4 instead of failing on 3 along the delta chain."""
    fleet = make_fleet(tmp_path, s3_endpoint, s3_bucket, relays)
    fleet.publish(1)
    replicator = Replicator(fleet.region, "b")
    replicator.replicate_once()
    fleet.publish(7)
    assert replicator.replicate_once() == list(range(1, 8))
    open_store("b", fleet.region.stores()["b"]).delete(mf.version_key(fleet.region.run, 3))
    with Hub(fleet.region, store="b") as node:
        state = node.materialize(2)
        assert same_bits(node.materialize(6, into=state, have_version=2), fleet.states[6])


# -- random partitions, heals and kills -----------------------------------------------------------------

OPS = st.lists(st.one_of(st.tuples(st.just("publish"), st.integers(1, 6)), st.just(("cut", 0)),
                         st.just(("heal", 0)), st.just(("kill", 0))), min_size=2, max_size=6)


@pytest.mark.slow
@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ops=OPS)
def test_random_partitions_heals_and_replicator_kills_never_leave_a_hole(
        tmp_path: pathlib.Path, s3_endpoint: str, s3_bucket: str, relays: RelayHub,
        ops: list[tuple[str, int]]) -> None:
    """After every operation, while the daemon works, the region store verifies whole (gapless from 0,
    every version verified, `latest` one of them); at the end, healed, it holds every version."""
    fleet = make_fleet(tmp_path, s3_endpoint, s3_bucket, relays, lease_ttl_s=SHORT_LEASE_TTL_S)
    fleet.publish(1)
    daemons = [ReplicatorDaemon(fleet.region_file, "b", tmp_path / f"{fleet.region.run}-0.log")]
    try:
        wait_for(lambda: fleet.latest() == 0, 60, "version 0 in region b")
        for op, n in ops:
            if op == "publish":
                fleet.publish(n)
            elif op == "cut":
                relays.cut(fleet.relay.name)
            elif op == "heal":
                relays.heal(fleet.relay.name)
            else:
                daemons[-1].kill()
                daemons.append(ReplicatorDaemon(fleet.region_file, "b",
                                                tmp_path / f"{fleet.region.run}-{len(daemons)}.log"))
            assert_whole(fleet.check())
        relays.heal(fleet.relay.name)
        newest = len(fleet.states) - 1
        wait_for(lambda: fleet.latest() == newest, 90, f"region b to reach {newest} after {ops}")
        check = fleet.check()
        assert_whole(check)
        assert check.versions == list(range(newest + 1))
    finally:
        for d in daemons:
            d.stop()
