"""The hub against moto's S3 server over HTTP, and the same races against directories."""

from __future__ import annotations

import pathlib
import threading
from typing import Any

import pytest
from hub_helpers import make_config, same_bits, step, tiny_state
from slowdown import scaled

from fleetrl.config import FleetConfig
from fleetrl.hub import Hub, ObjectExists, ObjectNotFound, VersionConflict, open_store
from fleetrl.hub.stores import ObjectStore

pytestmark = pytest.mark.integration


def config_for(kind: str, run: str, tmp_path: pathlib.Path, endpoint: str | None, bucket: str | None,
               **hub: Any) -> FleetConfig:
    home = f"s3://{bucket}/hub" if kind == "s3" else (tmp_path / "home").as_uri()
    return make_config(run, {"home": home}, s3_endpoint=endpoint, **hub)


@pytest.fixture(params=["dir", "s3"])
def kind(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
def store_config(kind: str, run_id: str, tmp_path: pathlib.Path, request: pytest.FixtureRequest) -> FleetConfig:
    if kind == "s3":
        endpoint, bucket = request.getfixturevalue("s3_endpoint"), request.getfixturevalue("s3_bucket")
        return config_for(kind, run_id, tmp_path, endpoint, bucket)
    return config_for(kind, run_id, tmp_path, None, None)


def test_store_basics(store_config: FleetConfig) -> None:
    store = open_store("home", store_config.hub.home_store)
    store.put("a/b/c", b"0123456789")
    assert store.get("a/b/c", 2, 6) == b"2345" and store.get("a/b/c") == b"0123456789"
    store.create("a/b/d", b"x")
    with pytest.raises(ObjectExists, match="a/b/d"):
        store.create("a/b/d", b"y")
    assert store.get("a/b/d") == b"x"
    assert [i.key for i in store.scan("a/b/")] == ["a/b/c", "a/b/d"]
    store.delete("a/b/c")
    assert not store.exists("a/b/c") and store.exists("a/b/d")
    with pytest.raises(ObjectNotFound, match="a/b/c"):
        store.get("a/b/c")


def test_chain_and_ranged_reads(store_config: FleetConfig) -> None:
    states = [tiny_state()]
    for i in range(1, 7):
        states.append(step(states[-1], i))
    with Hub.from_config(store_config) as hub:
        for s in states:
            hub.publish(s)
        for v in (0, 3, 6):
            assert same_bits(hub.materialize(v), states[v])
        hub.manifest(5)
        before = hub.store.stats.get_bytes
        into = {k: v.clone() for k, v in states[4].items()}
        hub.materialize(5, into=into, have_version=4)  # anchor 5's delta object only
        assert same_bits(into, states[5])
        assert hub.store.stats.get_bytes - before == sum(
            size for obj, size in hub.manifest(5).objects.items() if obj in hub.manifest(5).delta_objects())


def test_a_large_object_is_read_in_parallel_ranged_gets(store_config: FleetConfig) -> None:
    import torch

    state = {"w": torch.randn(700_000).to(torch.bfloat16)}  # 1.4 MB: 22 frames of 64 KiB
    with Hub.from_config(store_config) as hub:
        hub.publish(state)
        manifest = hub.manifest(0)
        assert len(manifest.objects) == 1 and len(manifest.tensors[0].parts) == 22
        before = hub.store.stats.gets
        assert same_bits(hub.materialize(0), state)
        assert 4 <= hub.store.stats.gets - before <= 6  # ranges of at most 4 frames (256 KiB)


def _racing(store: ObjectStore, barrier: threading.Barrier) -> ObjectStore:
    """Make both publishers reach the manifest's conditional create together."""
    base = type(store)

    class Racing(base):  # type: ignore[valid-type,misc]
        def _create(self, key: str, data: bytes) -> None:
            if "/versions/" in key:
                barrier.wait(timeout=scaled(20))
            super()._create(key, data)

    store.__class__ = Racing
    return store


def test_two_concurrent_publishers_of_one_version_exactly_one_wins(store_config: FleetConfig) -> None:
    barrier = threading.Barrier(2)
    hubs = [Hub(store_config, stores={"home": _racing(open_store("home", store_config.hub.home_store), barrier)})
            for _ in range(2)]
    results: list[object] = [None, None]

    def publish(i: int) -> None:
        try:
            results[i] = hubs[i].publish(tiny_state(seed=i)).version
        except VersionConflict as exc:
            results[i] = exc

    threads = [threading.Thread(target=publish, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=scaled(60))
    assert sorted(type(r).__name__ for r in results) == ["VersionConflict", "int"]
    winner = results.index(0)
    with Hub.from_config(store_config) as reader:
        assert reader.latest() == 0
        assert same_bits(reader.materialize(0), tiny_state(seed=winner))
    for h in hubs:
        h.close()
