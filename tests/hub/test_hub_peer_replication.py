"""Peer replication without home: three S3 servers (moto), the home one stopped.

Region `b` is cut off from home (the home server is stopped) but not from region `a`, which holds the
new version. `b`'s `fleetrl replicator` learns the version from the retained policy announcement and
`a`'s replica announcement, copies it from `a`'s store (manifest verified by its signature), announces
it, and a node of `b` (weight sync on a real torch engine) loads it.
"""

from __future__ import annotations

import asyncio
import hashlib
import pathlib
import time
from collections.abc import Iterator
from typing import Any

import boto3
import pytest
import torch
import yaml
from hub_helpers import ReplicatorDaemon as Daemon
from hub_helpers import wait_for
from slowdown import scaled

from fleetrl import devstack
from fleetrl.broker import ControlPlane, PolicyAnnouncement
from fleetrl.config import FleetConfig, load_config
from fleetrl.hub import Hub, ObjectNotFound, Replicator, StoreError, VersionHints
from fleetrl.hub import manifest as mf
from fleetrl.rollout.announcements import follow_announcements
from fleetrl.rollout.weights import WeightSync
from fleetrl.rollout.worker import build_engine

pytestmark = pytest.mark.integration
STORES = ("home", "a", "b")


@pytest.fixture
def s3_servers() -> Iterator[dict[str, devstack.ServerProcess]]:
    """One moto server per store, each with the bucket `fleetrl`; stopped by this fixture."""
    servers: dict[str, devstack.ServerProcess] = {}
    try:
        for name in STORES:
            servers[name] = devstack.moto_s3().start()
            boto3.client("s3", endpoint_url=f"http://127.0.0.1:{servers[name].port}",
                         region_name="us-east-1").create_bucket(Bucket="fleetrl")
        yield servers
    finally:
        for server in servers.values():
            server.stop()


def fleet_file(tmp_path: pathlib.Path, run_id: str, servers: dict[str, devstack.ServerProcess],
               mqtt_port: int) -> pathlib.Path:
    def store(name: str) -> dict[str, Any]:
        return {"url": f"s3://fleetrl/{name}", "endpoint_url": f"http://127.0.0.1:{servers[name].port}",
                "region_name": "us-east-1"}

    doc = {
        "run": run_id,
        "mqtt": {"url": f"mqtt://127.0.0.1:{mqtt_port}"},
        "hub": {"home_store": store("home"), "threads": 1, "poll_interval_s": 0.2, "lease_ttl_s": 3.0},
        "rollout": {"weight_fallback_poll_s": 600.0},
        # `b` prefers `a` anyway; home is the last resort of every region.
        "regions": [{"name": "a", "kafka": "127.0.0.1:9", "store": store("a"), "link_costs": {"home": 1}},
                    {"name": "b", "kafka": "127.0.0.1:9", "store": store("b"),
                     "link_costs": {"home": 5, "a": 1}}],
    }
    path = tmp_path / "fleet.yaml"
    path.write_text(yaml.safe_dump(doc))
    return path


def tiny_versions(config: FleetConfig, n: int) -> list[dict[str, torch.Tensor]]:
    """n versions of the config's tiny model (bf16), each a small step from the one before."""
    model = config.model.build()
    states = []
    g = torch.Generator().manual_seed(3)
    for _ in range(n):
        states.append({k: v.detach().to(torch.bfloat16).clone() for k, v in model.state_dict().items()})
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn(p.shape, generator=g) * 0.01)
    return states


async def announce_policy(config: FleetConfig, hub: Hub, version: int) -> None:
    """What the trainer's publisher announces (retained) once the version is in the home store."""
    raw = hub.store.get(mf.version_key(config.run, version))
    ann = PolicyAnnouncement(version=version, manifest=mf.version_key(config.run, version),
                             anchor=hub.manifest(version).anchor, sha256=hashlib.sha256(raw).hexdigest(),
                             published_at=time.time())
    async with ControlPlane(config, f"{config.run}-test-trainer", watch_nodes=False) as cp:
        await cp.announce_policy(ann)


class Node:
    """A rollout node of a region, as its worker runs it: announcement listener + weight sync on a real
    torch engine, reading its region store only. Runs on the test's event loop until `close()`."""

    def __init__(self, config: FleetConfig, region: str) -> None:
        self.engine = build_engine(config, region, "n0")
        self.hub = Hub.from_config(config, store=region)
        self.sync = WeightSync(self.hub, self.engine, config.rollout.weight_fallback_poll_s)
        self.tasks = [
            asyncio.create_task(follow_announcements(config, region, f"{config.run}-node-{region}", self.sync.notify)),
            asyncio.create_task(self.sync.run()),
        ]

    async def loaded(self, version: int, timeout_s: float) -> None:
        """Wait until the node has `version` (within `timeout_s`, the reference machine's figure, scaled)."""
        async with asyncio.timeout(scaled(timeout_s)):
            while self.sync.have is None or self.sync.have < version:
                for task in self.tasks:
                    if task.done():
                        task.result()  # a listener or puller that died says why
                await asyncio.sleep(0.1)
        self.engine.step()  # staged weights apply before the next decoding step

    async def close(self) -> None:
        for task in self.tasks:
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)
        self.hub.close()


async def test_region_cut_off_from_home_copies_a_new_version_from_a_peer_and_its_node_loads_it(
        tmp_path: pathlib.Path, run_id: str, s3_servers: dict[str, devstack.ServerProcess],
        mqtt_server: devstack.ServerProcess) -> None:
    config_file = fleet_file(tmp_path, run_id, s3_servers, mqtt_server.port)
    config = load_config(config_file)
    states = tiny_versions(config, 2)
    trainer = Hub.from_config(config)
    node = Node(config, "b")
    daemons: list[Daemon] = []
    try:
        # Before the partition: version 0 reaches both regions, and b's node loads it.
        await asyncio.to_thread(trainer.publish, states[0])
        await announce_policy(config, trainer, 0)
        daemons += [Daemon(config_file, "a", tmp_path / "a0.log"), Daemon(config_file, "b", tmp_path / "b0.log")]
        await node.loaded(0, 60)
        assert await asyncio.to_thread(daemons[1].stop) == 0  # b's replicator restarts during the partition

        # Version 1 reaches home and a; then home goes away.
        await asyncio.to_thread(trainer.publish, states[1])
        await announce_policy(config, trainer, 1)
        region_a = Hub.from_config(config, store="a")
        await asyncio.to_thread(wait_for, lambda: region_a.latest() == 1, 60, "version 1 to reach region a")
        region_a.close()
        await asyncio.to_thread(s3_servers["home"].stop)
        with pytest.raises(StoreError):
            await asyncio.to_thread(trainer.latest)

        # b learns version 1 from the control plane and copies it from a; its node loads it.
        b = Daemon(config_file, "b", tmp_path / "b1.log")
        daemons.append(b)
        await node.loaded(1, 90)
        assert node.engine.version == 1
        model_state = node.engine.model.state_dict()  # type: ignore[attr-defined]
        for name, tensor in states[1].items():
            assert torch.equal(model_state[name].to(torch.bfloat16), tensor), name
        copied = [e for e in b.events() if e.get("event") == "replicator.copied"]
        assert [(e["version"], e["source"]) for e in copied] == [(1, "a")]
        assert [e["event"] for e in b.events()].count("replicator.home_unreachable") == 1  # once, not per poll
    finally:
        for d in daemons:
            await asyncio.to_thread(d.stop)
        await node.close()
        trainer.close()


def test_hints_alone_find_the_version_and_a_store_that_holds_it(
        tmp_path: pathlib.Path, run_id: str, s3_servers: dict[str, devstack.ServerProcess]) -> None:
    """In process: with home stopped, nothing is known without hints; a peer's hint finds both the
    version and its holder; home's missing holder reference is written once home is back."""
    config = load_config(fleet_file(tmp_path, run_id, s3_servers, 9))
    states = tiny_versions(config, 2)
    with Hub.from_config(config) as trainer:
        for state in states:
            trainer.publish(state)
    Replicator(config, "a").replicate_once()
    s3_servers["home"].stop()
    hints = VersionHints()
    b = Replicator(config, "b", hints=hints)
    assert b.pending() == []  # home unreachable and nothing heard: nothing to do, no crash
    hints.hear("a", 1)
    assert b.pending() == [0, 1]  # from the anchor, found in a's store
    assert b.replicate_once() == [0, 1]
    with Hub.from_config(config, store="b") as node:
        assert node.latest() == 1
        node.materialize(1)  # the chain verifies end to end from b's own store
    home_ref = mf.holder_key(config.run, 1, "b")
    s3_servers["home"].start()  # moto keeps nothing: the bucket is new, the reference is still owed
    boto3.client("s3", endpoint_url=f"http://127.0.0.1:{s3_servers['home'].port}",
                 region_name="us-east-1").create_bucket(Bucket="fleetrl")
    with pytest.raises(ObjectNotFound):
        b.home.get(home_ref)
    assert b.replicate_once() == []
    assert b.home.get(home_ref) == b""
