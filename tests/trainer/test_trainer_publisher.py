"""WeightPublisher: background publishes land and are announced strictly in order; a failed one surfaces.

A real hub over a directory store; the announcer is an in-memory implementation of the control
plane's `announce_policy` (the MQTT side is covered by the service and resume tests).
"""

from __future__ import annotations

import asyncio
import pathlib
import threading
from collections.abc import Awaitable, Callable, Iterator, Mapping

import pytest
import torch
from slowdown import scaled

from fleetrl.broker import PolicyAnnouncement
from fleetrl.config import FleetConfig
from fleetrl.hub import Hub, VersionConflict
from fleetrl.trainer.metrics import TrainerMetrics
from fleetrl.trainer.publisher import WeightPublisher
from fleetrl.trainer.snapshots import SnapshotRing


class RecordingAnnouncer:
    def __init__(self) -> None:
        self.versions: list[int] = []

    async def announce_policy(self, announcement: PolicyAnnouncement) -> None:
        self.versions.append(announcement.version)


def _config(tmp_path: pathlib.Path) -> FleetConfig:
    return FleetConfig.model_validate({
        "run": "pub", "hub": {"home_store": str(tmp_path / "home"), "threads": 1, "frame_bytes": 65536},
        "regions": [{"name": "r1", "kafka": "127.0.0.1:9", "store": str(tmp_path / "r1")}],
    })


def _given(snapshot: dict[str, torch.Tensor]) -> Callable[[], Awaitable[dict[str, torch.Tensor]]]:
    async def take() -> dict[str, torch.Tensor]:
        return snapshot
    return take


def _weights(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    base = torch.randn(256, 64, generator=g)
    drift = torch.randn(256, 64, generator=torch.Generator().manual_seed(seed)) * 1e-3 * seed
    return {"w": (base + drift).to(torch.bfloat16), "b": torch.zeros(64, dtype=torch.bfloat16)}


async def test_submitted_versions_land_and_are_announced_in_order(tmp_path: pathlib.Path) -> None:
    announcer = RecordingAnnouncer()
    with Hub.from_config(_config(tmp_path)) as hub:
        publisher = WeightPublisher(hub, announcer, TrainerMetrics())
        first = await publisher.publish(_weights(0))
        assert first.version == 0
        snapshots = {v: _weights(v) for v in range(1, 6)}
        for v, snap in snapshots.items():  # no wait between submits: each waits for the one before
            await publisher.submit(_given(snap), v)
        last = await asyncio.wait_for(publisher.flush(), scaled(60))
        assert last is not None and last.version == 5 and publisher.last == last
        assert announcer.versions == [0, 1, 2, 3, 4, 5]
        assert hub.latest() == 5
        for v, snap in snapshots.items():
            assert hub.manifest(v).parent == v - 1 and hub.manifest(v).anchor == 0
            got = hub.materialize(v)
            assert all(torch.equal(got[k].view(torch.int16), snap[k].view(torch.int16)) for k in snap)


async def test_a_failed_background_publish_surfaces_at_the_next_submit(tmp_path: pathlib.Path) -> None:
    announcer = RecordingAnnouncer()
    with Hub.from_config(_config(tmp_path)) as hub:
        publisher = WeightPublisher(hub, announcer, TrainerMetrics())
        await publisher.publish(_weights(0))
        await publisher.submit(_given(_weights(1)), 7)  # version 1 is next: the hub refuses 7
        with pytest.raises(VersionConflict, match="asked to publish version 7 but the next version"):
            await asyncio.wait_for(publisher.submit(_given(_weights(2)), 8), scaled(60))
        assert await publisher.flush() is None  # the refused publish is not retried or left pending
        assert announcer.versions == [0] and hub.latest() == 0


def test_snapshots_stay_unchanged_until_the_ring_comes_round() -> None:
    ring = SnapshotRing(depth=3)
    weights = {"w": torch.randn(8, 8), "b": torch.zeros(8)}
    taken = []
    for _ in range(3):
        weights["w"].add_(1.0)
        taken.append(({k: v.to(torch.bfloat16) for k, v in weights.items()}, ring.take(weights, torch.bfloat16)))
    weights["w"].add_(1.0)
    fourth = ring.take(weights, torch.bfloat16)
    assert fourth["w"].data_ptr() == taken[0][1]["w"].data_ptr()  # the oldest set is used again
    for expected, snap in taken[1:]:  # the two before it are untouched
        assert all(torch.equal(snap[k].view(torch.int16), expected[k].view(torch.int16)) for k in expected)
    assert torch.equal(fourth["w"], weights["w"].to(torch.bfloat16)) and fourth["w"].dtype == torch.bfloat16


async def test_snapshots_cast_in_the_background_publish_exactly_with_the_default_two_buffer_sets(
        tmp_path: pathlib.Path) -> None:
    """The trainer's protocol: each step's snapshot is begun (cast in the ring's thread) only after the
    version before it landed, so with two buffer sets the one being cast is never the parent the hub
    still reads; every version pulls back bit for bit as the weights were when its cast began."""
    ring = SnapshotRing()
    assert ring.depth == 2
    weights = {"w": torch.randn(256, 64, generator=torch.Generator().manual_seed(1)), "b": torch.zeros(64)}
    expected = {}
    with Hub.from_config(_config(tmp_path)) as hub:
        publisher = WeightPublisher(hub, None, TrainerMetrics())
        await publisher.publish(ring.begin(weights, torch.bfloat16).result())
        for v in range(1, 7):
            ring.fence()  # as the optimizer update does before it changes the weights
            weights["w"].add_(torch.randn(256, 64, generator=torch.Generator().manual_seed(v)) * 0.05)
            expected[v] = {k: t.to(torch.bfloat16) for k, t in weights.items()}
            await publisher.submit(lambda: asyncio.to_thread(ring.begin, weights, torch.bfloat16), v)
        await asyncio.wait_for(publisher.flush(), scaled(60))
        ring.close()
        assert hub.latest() == 6
        for v, want in expected.items():
            got = hub.materialize(v)
            assert all(torch.equal(got[k].view(torch.int16), want[k].view(torch.int16)) for k in want), v


class _Gated(Mapping[str, torch.Tensor]):
    """A state dict whose tensors are handed out only once the test opens the gate: a cast that
    takes as long as the test wants."""

    def __init__(self, state: dict[str, torch.Tensor]) -> None:
        self.state, self.gate, self.reading = state, threading.Event(), threading.Event()

    def __getitem__(self, key: str) -> torch.Tensor:
        return self.state[key]

    def __iter__(self) -> Iterator[str]:
        self.reading.set()
        assert self.gate.wait(scaled(30))
        return iter(self.state)

    def __len__(self) -> int:
        return len(self.state)


def test_fence_waits_for_the_cast_still_running() -> None:
    ring = SnapshotRing()
    gated = _Gated({"w": torch.ones(4)})
    future = ring.begin(gated, torch.bfloat16)
    assert gated.reading.wait(scaled(30))
    fenced = threading.Event()
    fencer = threading.Thread(target=lambda: (ring.fence(), fenced.set()))
    fencer.start()
    assert not fenced.wait(0.3) and not future.done()  # the writer is held while the cast runs
    gated.gate.set()
    assert fenced.wait(scaled(30)) and future.done()
    fencer.join(scaled(30))
    assert torch.equal(future.result()["w"], torch.ones(4, dtype=torch.bfloat16))
    ring.close()
