"""Leases and replication: one WAN copy per region, from the cheapest holder, verified."""

from __future__ import annotations

import pathlib
import time

import pytest
from hub_helpers import make_config, same_bits, step, three_stores, tiny_state
from slowdown import scaled

from fleetrl.hub import DirStore, Hub, Lease, LeaseLost, Replicator, open_store
from fleetrl.hub.stores import ObjectStore

LEASE_TTL_S = scaled(3.0)
"""The leases' lifetime in the first test, scaled by the machine's slowdown: a's must outlive every step up
to the sleep, which a slower machine takes longer for."""


def test_lease_one_holder_renewal_expiry_steal_and_release(tmp_path: pathlib.Path) -> None:
    store = DirStore("r", tmp_path)
    # a's lease must outlive every step up to the sleep however busy the machine (0.4 s did not always)
    a = Lease(store, "run", "replicator", ttl_s=LEASE_TTL_S, holder="a")
    b = Lease(store, "run", "replicator", ttl_s=LEASE_TTL_S, holder="b")
    assert a.acquire() and a.held
    assert not b.acquire() and not b.held
    a.renew()
    assert store.scan("run/lease/") and len(store.scan("run/lease/")) <= 2  # old generations cleaned
    time.sleep(LEASE_TTL_S + 0.1)  # a died without renewing: its record expires
    assert not a.held
    assert b.acquire() and b.held
    current = b.current()
    assert current is not None and current.holder == "b"
    with pytest.raises(LeaseLost):
        a.renew()
    b.release()
    assert a.acquire()


@pytest.mark.integration
@pytest.mark.parametrize("kind", ["dir", "s3"])
def test_each_version_crosses_between_stores_once_per_region(
        kind: str, run_id: str, tmp_path: pathlib.Path, request: pytest.FixtureRequest) -> None:
    config = three_stores(kind, run_id, tmp_path, request, anchor_interval=5)

    def clients() -> dict[str, ObjectStore]:  # one client per actor: its counters are its own reads
        return {n: open_store(n, c) for n, c in config.stores().items()}

    with Hub.from_config(config) as trainer:
        states = [tiny_state()]
        trainer.publish(states[0])
        for v in range(1, 5):
            states.append(step(states[-1], v))
            trainer.publish(states[-1])
        total = sum(sum(trainer.manifest(v).objects.values()) for v in range(5))
        n_objects = len({o for v in range(5) for o in trainer.manifest(v).objects})

    near_view, far_view = clients(), clients()
    assert Replicator(config, "near", stores=near_view).replicate_once() == [0, 1, 2, 3, 4]
    assert Replicator(config, "far", stores=far_view).replicate_once() == [0, 1, 2, 3, 4]
    assert near_view["home"].stats.object_bytes == total and near_view["home"].stats.object_gets == n_objects
    assert far_view["near"].stats.object_bytes == total  # the cheaper peer, not home
    assert far_view["home"].stats.object_gets == 0 and near_view["far"].stats.object_gets == 0
    assert Replicator(config, "far", stores=far_view).replicate_once() == []  # nothing twice

    # Four nodes per region read only their region store: no object crosses again.
    for region in ("near", "far"):
        for _ in range(4):
            view = clients()
            with Hub(config, store=region, stores=view) as node:
                assert node.holders(4) == [region]  # its own peer reference
                state = node.materialize(0)
                for v in range(1, 5):
                    state = node.materialize(v, into=state, have_version=v - 1)
                assert same_bits(state, states[4])
            assert all(view[n].stats.object_gets == 0 for n in view if n != region)

    # Peer references in the home store name every holder.
    with Hub.from_config(config) as home:
        assert home.holders(4) == ["far", "home", "near"]


@pytest.mark.integration
def test_a_replicator_that_joins_late_starts_from_the_newest_anchor(run_id: str, tmp_path: pathlib.Path) -> None:
    urls = {n: (tmp_path / n).as_uri() for n in ("home", "near")}
    config = make_config(run_id, urls, link_costs={"near": {"home": 1}}, anchor_interval=3)
    with Hub.from_config(config) as trainer:
        state = tiny_state()
        for v in range(8):
            trainer.publish(state)
            state = step(state, v + 1)
    replicator = Replicator(config, "near")
    assert replicator.replicate_once() == [6, 7]
    with Hub.from_config(config, store="near") as node:
        assert node.latest() == 7 and node.versions() == [6, 7]


@pytest.mark.integration
def test_holder_references_owed_home_by_a_killed_replicator_are_written_by_the_next(
        run_id: str, tmp_path: pathlib.Path) -> None:
    """A replicator killed while home was unreachable owed home its holder references (in memory only)
    and had moved the region's `latest` on: the next replicator finds and writes them."""
    urls = {n: (tmp_path / n).as_uri() for n in ("home", "near")}
    config = make_config(run_id, urls, link_costs={"near": {"home": 1}}, anchor_interval=3)
    with Hub.from_config(config) as trainer:
        state = tiny_state()
        for v in range(3):
            trainer.publish(state)
            state = step(state, v + 1)
    assert Replicator(config, "near").replicate_once() == [0, 1, 2]
    home = open_store("home", config.stores()["home"])
    for v in (1, 2):  # what the killed one could not write home
        home.delete(f"{run_id}/holders/{v:012d}/near")
    with Hub.from_config(config) as hub:
        assert hub.holders(1) == ["home"] and hub.holders(0) == ["home", "near"]
    assert Replicator(config, "near").replicate_once() == []  # nothing to copy: the region holds it all
    with Hub.from_config(config) as hub:
        assert [sorted(hub.holders(v)) for v in range(3)] == [["home", "near"]] * 3
